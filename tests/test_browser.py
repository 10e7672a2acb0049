"""Browser test: ComfyUI's server (CPU) with its pinned comfyui-frontend-package and our pack installed,
driven by Playwright in Debian's headless Chromium (never a browser Playwright downloads; every
non-loopback request is blocked). Our nodes are in the node library search, one can be added to an empty
graph, and every bundled workflow loads with no missing-node error. Screenshots go to a temporary folder,
or to $SPARSE_ATTN_SCREENSHOTS when set (`SPARSE_ATTN_SCREENSHOTS=docs/images` refreshes the README's,
which come from ComfyUI 0.33.0).

Needs COMFYUI_PATH, the `playwright` package and Debian's chromium (/usr/bin/chromium).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, comfyui_path, comfyui_version, workflow_needs

pytestmark = [pytest.mark.comfyui, pytest.mark.browser]
CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
NODE_IDS = ["SparseAttn_Patch", "SparseAttn_Preset", "SparseAttn_Report", "SparseAttn_Compare",
            "SparseAttn_Record", "SparseAttn_Calibrate"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require = os.environ.get("SPARSE_ATTN_REQUIRE_BROWSER") == "1"
    if not Path(CHROMIUM).exists():
        if require:
            pytest.fail(f"SPARSE_ATTN_REQUIRE_BROWSER=1 but there is no chromium at {CHROMIUM}")
        pytest.skip(f"!!! no Debian chromium at {CHROMIUM}: browser test SKIPPED !!!")
    if require:
        import playwright  # noqa: F401  (fail loudly when required)
    pytest.importorskip("playwright")
    base = tmp_path_factory.mktemp("comfy-base")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / "comfyui-sparse-attention").symlink_to(ROOT, target_is_directory=True)
    port = _free_port()
    log = open(base / "server.log", "w")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([sys.executable, "main.py", "--cpu", "--disable-api-nodes", "--listen", "127.0.0.1",
                             "--port", str(port), "--base-directory", str(base)],
                            cwd=str(comfyui_path()), stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError("ComfyUI exited:\n" + (base / "server.log").read_text()[-5000:])
        try:
            urllib.request.urlopen(url + "/object_info/SparseAttn_Patch", timeout=5)
            break
        except OSError:
            time.sleep(1)
    else:
        proc.kill()
        raise AssertionError("ComfyUI did not answer:\n" + (base / "server.log").read_text()[-5000:])
    yield url, base
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_server_registers_nodes_and_templates(server):
    url, _ = server
    info = json.loads(urllib.request.urlopen(url + "/object_info").read())
    for nid in NODE_IDS:
        assert nid in info and info[nid]["category"] == "model_patches/sparse_attention"
    templates = json.loads(urllib.request.urlopen(url + "/api/workflow_templates").read())
    assert sorted(templates["comfyui-sparse-attention"]) == sorted(p.stem for p in (ROOT / "workflows").glob("*.json"))


def test_frontend_search_add_and_load_workflows(server, tmp_path):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    url, _ = server
    IMAGES = Path(os.environ.get("SPARSE_ATTN_SCREENSHOTS") or tmp_path)  # noqa: N806
    IMAGES.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        blocked = []

        def guard(route):
            host = route.request.url.split("/")[2] if "://" in route.request.url else ""
            if host.startswith(("127.0.0.1", "localhost")) or route.request.url.startswith(("data:", "blob:")):
                return route.continue_()
            blocked.append(route.request.url)
            return route.abort()
        page.route("**/*", guard)
        # skip the first-run template browser so the canvas is usable
        settings = json.dumps({"Comfy.TutorialCompleted": True, "Comfy.Workflow.ShowMissingModelsWarning": False})
        urllib.request.urlopen(urllib.request.Request(url + "/settings", data=settings.encode(), method="POST"))
        page.goto(url, wait_until="domcontentloaded")
        page.wait_for_function("() => window.app && window.app.graph && window.LiteGraph", timeout=120_000)
        page.wait_for_timeout(2000)
        registered = page.evaluate("ids => ids.filter(i => !!window.LiteGraph.registered_node_types[i])", NODE_IDS)
        assert registered == NODE_IDS
        # the node library's search finds our node
        page.evaluate("() => { window.app.graph.clear(); }")
        # a busy machine can miss the first double click (the page still settling, a toast over the canvas):
        # try again rather than wait a fixed time; the typed query sits in an input, not in innerText
        for _ in range(3):
            page.mouse.dblclick(700, 450)
            page.keyboard.type("Sparse Attention", delay=30)
            try:
                page.wait_for_function("() => document.body.innerText.includes('Sparse Attention')", timeout=20_000)
                break
            except PlaywrightTimeout:
                page.keyboard.press("Escape")
        page.screenshot(path=str(IMAGES / "node_search.png"))
        found = page.evaluate("() => document.body.innerText")
        assert "Sparse Attention" in found
        page.keyboard.press("Escape")
        # add one to an empty graph
        widgets = page.evaluate("""() => { window.app.graph.clear();
            const n = window.LiteGraph.createNode('SparseAttn_Patch'); window.app.graph.add(n);
            n.pos = [200, 200]; window.app.canvas.setDirty(true, true);
            return n.widgets.map(w => w.name); }""")
        assert widgets[:3] == ["method", "density", "block_size"]
        page.wait_for_timeout(500)
        page.screenshot(path=str(IMAGES / "node_added.png"))
        # every bundled workflow loads with no missing node
        for path in sorted((ROOT / "workflows").glob("*.json")):
            doc = json.loads(path.read_text())
            if comfyui_version() < workflow_needs(doc):
                continue  # a model this ComfyUI does not have (its nodes are missing here by design)
            missing = page.evaluate(LOAD_AND_LIST_MISSING, doc)
            assert missing == [], f"{path.name}: missing {missing}"
            dialog = page.evaluate("() => document.body.innerText.includes('missing nodes')")
            assert not dialog, f"{path.name}: the missing-nodes dialog opened"
            page.wait_for_timeout(800)
            page.screenshot(path=str(IMAGES / f"workflow_{path.stem}.png"))
        # negative control: a workflow with an unknown node is reported (the check and the frontend see it)
        bad = json.loads((ROOT / "workflows" / "video_wan2_1_t2v_1.3b.json").read_text())
        bad["nodes"].append({"id": 9999, "type": "NoSuchNodeXYZ", "pos": [0, 0], "size": [200, 60], "flags": {},
                             "order": 0, "mode": 0, "inputs": [], "outputs": [], "properties": {}})
        assert page.evaluate(LOAD_AND_LIST_MISSING, bad) == ["NoSuchNodeXYZ"]
        page.wait_for_timeout(1500)
        page.screenshot(path=str(IMAGES / "negative_control_missing_node.png"))
        text = page.evaluate("() => document.body.innerText")
        assert "NoSuchNodeXYZ" in text or "errors found" in text  # dialog (1.3x frontends) or error panel (1.4x)
        browser.close()
    assert all("127.0.0.1" not in u for u in blocked)


LOAD_AND_LIST_MISSING = """async (doc) => {
                window.app.graph.clear();
                await window.app.loadGraphData(doc);
                const types = new Set();
                const visit = (g) => { for (const n of (g.nodes || g._nodes || [])) types.add(n.type); };
                visit(window.app.graph);
                for (const sg of (doc.definitions?.subgraphs || [])) for (const n of sg.nodes) types.add(n.type);
                const sub = new Set((doc.definitions?.subgraphs || []).map(s => s.id));
                const frontendOnly = new Set(['Note', 'MarkdownNote', 'Reroute', 'PrimitiveNode']);
                return [...types].filter(t => !sub.has(t) && !frontendOnly.has(t)
                                              && !window.LiteGraph.registered_node_types[t]);
            }"""
