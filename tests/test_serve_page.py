"""The page at / (mlm_jax/static/index.html) in a real headless Chromium, over loopback: the
prompt and the continuation in their own spans, token counts and speed, errors shown as errors
with the output cleared, the button enabled again, temperature 0 = greedy, and a non-JSON
error body shown with its HTTP status.

Chromium is a system package, not a pip one: without it these tests skip with the line that
installs it, so the README's test command passes on a fresh machine. `.ci/run` installs it and
sets MLM_JAX_REQUIRE_BROWSER=1, under which a missing browser fails the tests instead."""

import html.parser
import os
import re
import shutil
import subprocess
import urllib.parse

import pytest

import mlm_jax
from mlm_jax.serve import make_app
from mlm_jax.serve.app import STATIC
from tests.gen_util import make_gpt2
from tests.test_serve import Server, _put

IDS = ("status", "stats", "output", "out-prompt", "out-new", "go")
STATS = re.compile(r"^(\d+) prompt tokens?, (\d+) new tokens?, (\d+\.\d) s, (\d+\.\d|-) tokens/s$")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_CHROMIUM = "chromium is not installed (a headless browser drives the page): apt-get install chromium"
REQUIRE_BROWSER = os.environ.get("MLM_JAX_REQUIRE_BROWSER", "") not in ("", "0")
pytestmark = pytest.mark.skipif(CHROMIUM is None and not REQUIRE_BROWSER, reason=NO_CHROMIUM)


@pytest.fixture(scope="module")
def page_server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("serve_page") / "gpt2")
    make_gpt2(folder)
    server = Server(make_app(mlm_jax.load(folder), max_batch=16, max_queue=64, timeout=60.0))
    yield server
    server.close()


class _Elements(html.parser.HTMLParser):
    """The attributes and the text (nested text included) of the elements with the ids in IDS."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.attrs, self.text, self.open = {}, {}, []  # open: [id or None, ...] per open element

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        ident = attrs.get("id") if attrs.get("id") in IDS else None
        if ident:
            self.attrs[ident], self.text[ident] = attrs, ""
        if tag not in ("input", "br", "meta", "img", "hr", "link"):
            self.open.append(ident)

    def handle_endtag(self, tag):
        if tag not in ("input", "br", "meta", "img", "hr", "link") and self.open:
            self.open.pop()

    def handle_data(self, data):
        for ident in self.open:
            if ident:
                self.text[ident] += data


def _page(url: str, **params) -> _Elements:
    assert CHROMIUM, NO_CHROMIUM + " (MLM_JAX_REQUIRE_BROWSER is set: CI runs these tests)"
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--virtual-time-budget=20000", "--dump-dom", url + "/?" + urllib.parse.urlencode(params)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    page = _Elements()
    page.feed(r.stdout)
    assert set(IDS) <= set(page.attrs), r.stdout[-2000:]
    return page


def _greedy(url: str, prompt: str, tokens: int) -> dict:
    r = _put(url, {"prompts": [prompt], "tokens_to_generate": tokens, "top_k": 1})
    assert r.status_code == 200, r.text
    return r.json()


def test_success_shows_prompt_continuation_and_counts(page_server):
    prompt = "w5 w9 w13"
    want = _greedy(page_server.url, prompt, 4)
    page = _page(page_server.url, prompt=prompt, tokens="4")  # the page's default temperature 0: greedy
    text, segments = want["text"][0], want["segments"][0]
    assert page.text["out-prompt"] == prompt
    assert page.text["out-new"] == text[len(prompt):] and page.text["out-new"].strip()
    assert page.text["output"] == text
    m = STATS.match(page.text["stats"].strip())
    assert m, page.text["stats"]
    assert (int(m.group(1)), int(m.group(2))) == (3, len(segments) - 3), page.text["stats"]
    assert page.text["status"].strip() == "done" and "error" not in page.attrs["status"].get("class", "")
    assert "disabled" not in page.attrs["go"]


def test_refused_request_shows_the_error_and_clears_the_output(page_server):
    r = _put(page_server.url, {"prompts": ["w1"], "tokens_to_generate": 100000, "top_k": 1})
    assert r.status_code == 400 and r.json()["field"] == "tokens_to_generate"
    page = _page(page_server.url, prompt="w1", tokens="100000")
    assert "error" in page.attrs["status"].get("class", "").split()
    assert r.json()["error"] in page.text["status"] and "tokens_to_generate" in page.text["status"]
    assert "400" in page.text["status"]
    assert page.text["out-prompt"] == "" and page.text["out-new"] == "" and page.text["stats"] == ""
    assert "disabled" not in page.attrs["go"]


def test_temperature_zero_is_greedy(page_server):
    prompt = "w40 w2 w7"
    want = _greedy(page_server.url, prompt, 4)["text"][0]
    # top_k 5 in the URL is overridden: temperature 0 sends top_k 1 (and temperature 1.0, refused as 0)
    for extra in ({}, {"top_k": "5"}, {"top_p": "0.9"}):
        page = _page(page_server.url, prompt=prompt, tokens="4", temperature="0", **extra)
        assert page.text["status"].strip() == "done", (extra, page.text["status"])
        assert page.text["out-prompt"] == prompt and page.text["out-prompt"] + page.text["out-new"] == want, extra


def test_sampling_parameters_from_the_url(page_server):
    """temperature, top_k from the URL reach the server: top_k 1 at temperature 0.7 is greedy too."""
    prompt = "w11 w12"
    want = _greedy(page_server.url, prompt, 3)["text"][0]
    page = _page(page_server.url, prompt=prompt, tokens="3", temperature="0.7", top_k="1")
    assert page.text["status"].strip() == "done", page.text["status"]
    assert page.text["output"] == want
    bad = _page(page_server.url, prompt=prompt, tokens="3", temperature="0.7", top_k="2", top_p="0.5")
    assert "error" in bad.attrs["status"].get("class", "").split() and "top_p" in bad.text["status"]


def test_non_json_error_body_shows_the_http_status():
    from starlette.applications import Starlette
    from starlette.responses import FileResponse, PlainTextResponse
    from starlette.routing import Route

    async def page(request):
        return FileResponse(os.path.join(STATIC, "index.html"), media_type="text/html")

    async def api(request):
        return PlainTextResponse("upstream exploded", status_code=502)

    server = Server(Starlette(routes=[Route("/", page), Route("/api", api, methods=["PUT"])]))
    try:
        got = _page(server.url, prompt="w1", tokens="2")
    finally:
        server.close()
    assert "error" in got.attrs["status"].get("class", "").split()
    assert "502" in got.text["status"] and "upstream exploded" in got.text["status"]
    assert got.text["out-prompt"] == "" and got.text["out-new"] == ""
    assert "disabled" not in got.attrs["go"]


def test_error_after_success_clears_the_previous_output():
    """A second Generate (clicked by a script added to the page) that the server refuses: the first
    output and stats are cleared, the error shows, the button is enabled again."""
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse, JSONResponse
    from starlette.routing import Route

    with open(os.path.join(STATIC, "index.html")) as f:
        source = f.read()
    again = """<script>
const watch = setInterval(() => {
  if (document.getElementById("status").textContent === "done") {
    clearInterval(watch); document.getElementById("go").click();
  }
}, 50);
</script></body>"""
    calls = []

    async def page(request):
        return HTMLResponse(source.replace("</body>", again))

    async def api(request):
        calls.append(await request.json())
        if len(calls) == 1:
            return JSONResponse({"text": ["w1 w2 w3"], "segments": [["w1", " w2", " w3"]], "logprobs": None})
        return JSONResponse({"error": "refused the second time", "field": "prompts"}, status_code=400)

    server = Server(Starlette(routes=[Route("/", page), Route("/api", api, methods=["PUT"])]))
    try:
        got = _page(server.url, prompt="w1", tokens="2")
    finally:
        server.close()
    assert len(calls) == 2 and calls[0] == calls[1]
    assert calls[0]["top_k"] == 1 and calls[0]["temperature"] == 1.0 and calls[0]["tokens_to_generate"] == 2
    assert "error" in got.attrs["status"].get("class", "").split()
    assert "refused the second time" in got.text["status"] and "prompts" in got.text["status"]
    assert got.text["out-prompt"] == "" and got.text["out-new"] == "" and got.text["stats"] == ""
    assert "disabled" not in got.attrs["go"]


def test_prompt_that_does_not_round_trip_is_split_by_token_count():
    """The returned text does not start with the prompt (the tokenizer normalised it): the page asks
    for the prompt's tokens alone (tokens_to_generate 0, logprobs) and splits the segments there."""
    from starlette.applications import Starlette
    from starlette.responses import FileResponse, JSONResponse
    from starlette.routing import Route

    calls = []

    async def page(request):
        return FileResponse(os.path.join(STATIC, "index.html"), media_type="text/html")

    async def api(request):
        body = await request.json()
        calls.append(body)
        if body["tokens_to_generate"] == 0:
            return JSONResponse({"text": ["w1 w2"], "segments": [["w1", " w2"]], "logprobs": [[-1.5]]})
        return JSONResponse({"text": ["w1 w2 w3 w4"], "segments": [["w1", " w2", " w3", " w4"]],
                             "logprobs": None})

    server = Server(Starlette(routes=[Route("/", page), Route("/api", api, methods=["PUT"])]))
    try:
        got = _page(server.url, prompt="w1   w2", tokens="2")
    finally:
        server.close()
    assert [c["tokens_to_generate"] for c in calls] == [2, 0] and calls[1]["logprobs"] is True
    assert got.text["status"].strip() == "done", got.text["status"]
    assert got.text["out-prompt"] == "w1 w2" and got.text["out-new"] == " w3 w4"
    m = STATS.match(got.text["stats"].strip())
    assert m and (m.group(1), m.group(2)) == ("2", "2"), got.text["stats"]
