"""The documentation site's generated page is current: docs/reference/flags.md is what
`python -m mlm_jax.docs_flags` writes from mlm_jax/arguments.py now, so a flag added, renamed or
re-described without regenerating the page fails here. (The site's build, broken links
included, runs in `.ci/run` with `mkdocs build --strict`.)"""

import os

from mlm_jax import arguments, docs_flags

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_flag_reference_is_current():
    with open(os.path.join(ROOT, docs_flags.PAGE)) as f:
        page = f.read()
    assert page == docs_flags.render(), (
        f"{docs_flags.PAGE} is stale: regenerate it with `python -m mlm_jax.docs_flags`")


def test_flag_reference_lists_every_flag():
    page = docs_flags.render()
    parser = arguments.build_parser()
    flags = [s for action in parser._actions for s in action.option_strings if s.startswith("--") and s != "--help"]
    assert len(flags) > 150
    for flag in flags:
        assert f"| `{flag}` |" in page, f"{flag} is missing from the flag reference"


def test_readme_is_the_short_front_door_with_the_quickstart_commands():
    """README.md stays a page a newcomer reads in minutes (the guides live in docs/), and it keeps
    the two quickstart commands exactly as a new user copies them (docs/getting-started quotes
    them too)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 150
    assert "pip install -e . && python -m mlm_jax.train\n" in readme
    assert 'pip install -e ".[test]" && python -m pytest tests\n' in readme
