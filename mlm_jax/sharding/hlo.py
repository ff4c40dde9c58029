"""Read the collectives out of a compiled program's HLO text.

Tests and benchmarks use this to compare what XLA emitted against Megatron's analytic counts
(per layer: TP has 2 all-reduces forward and 2 backward; SP turns each into an all-gather
before a column-parallel matmul and a reduce-scatter after a row-parallel one).

XLA:CPU has no pass that fuses "all-reduce then keep my slice" into a reduce-scatter (XLA:GPU's
pipeline has one), so on CPU an all-reduce whose every use slices out this device's part is
reported as `scattered`: the partitioner's reduce-scatter, in CPU spelling.
"""

from __future__ import annotations

import dataclasses
import re

_COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.+?)\s+([a-z][a-z0-9-]*)\((.*)$")
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_COMP = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s.*\{\s*$")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # all-reduce, reduce-scatter, all-gather, all-to-all, collective-permute
    shapes: tuple[tuple[int, ...], ...]  # result shape of each operand (combined ops have several)
    op_name: str  # JAX's name stack: which traced operation it came from
    scattered: tuple[bool, ...]  # per operand: all-reduced, then only a slice kept (CPU's RS)

    @property
    def backward(self) -> bool:
        return "transpose(" in self.op_name

    @property
    def in_layer_scan(self) -> bool:
        """Inside the scan over layers (one body, run num_layers times)."""
        return self.op_name.count("/while/body/") >= 2


def _shapes(type_text: str) -> tuple[tuple[int, ...], ...]:
    return tuple(
        tuple(int(d) for d in dims.split(",") if d) for _, dims in _SHAPE.findall(type_text)
    )


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction of an optimized HLO module (`compiled.as_text()`)."""
    instrs = _instructions(hlo_text)
    users = _users(instrs)
    found = []
    for name, (type_text, opcode, rest, _) in instrs.items():
        kind = opcode.removesuffix("-start")
        if kind not in _COLLECTIVES:
            continue
        op_name = re.search(r'op_name="([^"]*)"', rest)
        found.append(Collective(
            kind=kind,
            shapes=_shapes(type_text),
            op_name=op_name.group(1) if op_name else "",
            scattered=(_scattered(name, type_text, instrs, users) if kind == "all-reduce"
                       else (False,) * len(_shapes(type_text))),
        ))
    return found


# name -> (result type, opcode, the text after "opcode(", computation)
_Instructions = dict[str, tuple[str, str, str, str]]


def _instructions(hlo_text: str) -> _Instructions:
    """Every instruction inside a computation, by name."""
    current = None
    instrs: _Instructions = {}
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0]:
            current = m.group(1)
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            name, type_text, opcode, rest = m.groups()
            instrs[name] = (type_text, opcode, rest, current)
    return instrs


def _users(instrs: _Instructions) -> dict[str, list[str]]:
    """name -> the instructions that take it as an operand."""
    users: dict[str, list[str]] = {}
    for name, (_, _, rest, _) in instrs.items():
        operand_text = rest.split("), ")[0]
        for ref in re.findall(r"%([\w.\-]+)", operand_text):
            users.setdefault(ref, []).append(name)
    return users


def _size(type_text: str) -> int:
    """Elements in all the shapes of an HLO type."""
    total = 0
    for shape in _shapes(type_text):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def _slices(name: str, whole: int, instrs: _Instructions, users: dict[str, list[str]]) -> bool:
    """Does every use of `name` keep only part of it?"""
    uses = users.get(name, [])
    return bool(uses) and all(
        instrs[u][1] in ("dynamic-slice", "slice", "fusion") and _size(instrs[u][0]) < whole
        for u in uses
    )


def _scattered(name: str, type_text: str, instrs: _Instructions, users: dict[str, list[str]]) -> tuple[bool, ...]:
    """Per operand of an all-reduce: is only a slice of its result used (CPU's reduce-scatter)?"""
    shapes = _shapes(type_text)
    if len(shapes) == 1:
        return (_slices(name, _size(type_text), instrs, users),)
    out = [False] * len(shapes)
    for use in users.get(name, []):
        use_type, opcode, rest, _ = instrs[use]
        index = re.search(r"index=(\d+)", rest)
        if opcode == "get-tuple-element" and index:
            out[int(index.group(1))] = _slices(use, _size(use_type), instrs, users)
    return tuple(out)


def count(found: list[Collective], kind: str, shape: tuple[int, ...], *, backward: bool,
          in_layer_scan: bool = True, scattered: bool | None = None) -> int:
    """How many operands of `shape` move in collectives of `kind` in the given region.

    `scattered` (all-reduces only): True counts the CPU spelling of reduce-scatter, False the
    true all-reduces, None both.
    """
    n = 0
    for c in found:
        if c.kind != kind or c.backward != backward or c.in_layer_scan != in_layer_scan:
            continue
        for s, sc in zip(c.shapes, c.scattered):
            if s == shape and (scattered is None or sc == scattered):
                n += 1
    return n
