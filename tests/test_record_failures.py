"""Record and Calibrate failures inside a real ComfyUI (needs COMFYUI_PATH): an output folder that cannot be
written is refused before sampling, layers the model lacks stop sampling after the first forward, a recording
that cannot be saved keeps the sampler's result (logged, no half-written file, Calibrate says why), and a
recording file replaced at a typed path changes Calibrate's fingerprint (ComfyUI's cache re-runs it)."""

import pytest
from comfy_subprocess import run_in_comfyui
from conftest import ROOT, comfyui_path

pytestmark = pytest.mark.comfyui

BODY = """
import asyncio, logging, os, shutil, sys, torch
sys.path.insert(0, {tests!r})
import comfy_child as C
pack = C.load_pack()
import folder_paths
OUT = {out!r}
folder_paths.set_output_directory(OUT)
from comfyui_sparse_attention.nodes.nodes_calibrate import SparseAttentionRecord, SparseAttentionCalibrate
from comfyui_sparse_attention.nodes import record as record_mod
r = {{"is_root": os.geteuid() == 0}}

def result(node_out):
    return node_out.result if hasattr(node_out, "result") else node_out

class Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines = []
    def emit(self, rec):
        self.lines.append(rec.getMessage())
errors = Errors()
logging.getLogger().addHandler(errors)

def record_error(prefix, layers="1"):
    try:
        result(SparseAttentionRecord.execute(model, layers, "0, 3", 64.0, prefix))
        return "no error"
    except Exception as exc:
        return f"{{type(exc).__name__}}: {{exc}}"

def calibrate_error(path):
    try:
        SparseAttentionCalibrate.execute(path, "block_topk", 0.3, "64", True, "", "fail/cal", None, None)
        return "no error"
    except Exception as exc:
        return f"{{type(exc).__name__}}: {{exc}}"

model, latent, pos, neg = C.build("wan")
base = C.sample(model, latent, pos, neg, steps=4)

# (a) an output folder that cannot be written: refused by the Record node itself, before any sampling
open(os.path.join(OUT, "blocker"), "w").close()  # a regular file where the folder should be (works as root too)
r["blocked"] = record_error("blocker/qkv")
r["blocked_folder"] = os.path.join(OUT, "blocker")
if not r["is_root"]:  # root writes into a read-only folder regardless: only the case above applies then
    ro = os.path.join(OUT, "ro")
    os.makedirs(ro)
    os.chmod(ro, 0o555)
    try:
        r["readonly"] = record_error("ro/qkv")
    finally:
        os.chmod(ro, 0o755)
    r["readonly_folder"] = ro
r["ok"] = record_error("fine/qkv")
r["probe_left"] = os.listdir(os.path.join(OUT, "fine"))

# (b) layers the model lacks: refused after the first forward, naming them
calls_full = []
counted = model.clone()
counted.model_options.setdefault("transformer_options", {{}})["optimized_attention_override"] = \\
    C.recording_override(calls_full)
C.sample(counted, latent, pos, neg, steps=4)
calls = []
counted = model.clone()
counted.model_options.setdefault("transformer_options", {{}})["optimized_attention_override"] = \\
    C.recording_override(calls)
late, late_path = result(SparseAttentionRecord.execute(counted, "1, 7, 9", "0, 3", 64.0, "late/qkv"))
try:
    C.sample(late, latent, pos, neg, steps=4)
    r["missing_layers"] = "no error"
except Exception as exc:
    r["missing_layers"] = f"{{type(exc).__name__}}: {{exc}}"
r["calls_full"], r["calls_refused"] = len(calls_full), len(calls)
r["late_written"] = os.path.exists(late_path)

# (c) the folder disappears after the node ran: the save fails, the sampled latent is kept
rec_model, path = result(SparseAttentionRecord.execute(model, "1", "0, 3", 64.0, "gone/qkv"))
shutil.rmtree(os.path.join(OUT, "gone"))
open(os.path.join(OUT, "gone"), "w").close()
errors.lines.clear()
try:
    out = C.sample(rec_model, latent, pos, neg, steps=4)
    r["gone_kept"] = C.rel(out, base)
except Exception as exc:
    r["gone_kept"] = f"{{type(exc).__name__}}: {{exc}}"
r["gone_path"] = path
r["gone_exists"] = os.path.exists(path) or os.path.exists(path + ".partial")
r["gone_log"] = list(errors.lines)
r["gone_calibrate"] = calibrate_error(path)
# fixed and run again (the cached Record node, same path): written, the failure forgotten
os.remove(os.path.join(OUT, "gone"))
C.sample(rec_model, latent, pos, neg, steps=4)
r["rerun_written"] = os.path.exists(path)
r["rerun_failure"] = record_mod.save_failure(path)

# (c) a write that fails half-way (e.g. the disk turns read-only): nothing half-written stays
import safetensors.torch as st
real_save = st.save_file
def failing_save(tensors, filename, metadata=None):
    with open(filename, "wb") as f:
        f.write(b"half a file")
    raise OSError("I/O error: Read-only file system (os error 30)")
mid_model, mid_path = result(SparseAttentionRecord.execute(model, "1", "0, 3", 64.0, "mid/qkv"))
st.save_file = failing_save
errors.lines.clear()
try:
    out = C.sample(mid_model, latent, pos, neg, steps=4)
    r["mid_kept"] = C.rel(out, base)
except Exception as exc:
    r["mid_kept"] = f"{{type(exc).__name__}}: {{exc}}"
finally:
    st.save_file = real_save
r["mid_left"] = os.listdir(os.path.join(OUT, "mid"))
r["mid_path"] = mid_path
r["mid_log"] = list(errors.lines)
r["mid_calibrate"] = calibrate_error(mid_path)

# 2. Calibrate's fingerprint follows the file at a typed path, through ComfyUI's own IsChangedCache
import nodes
import execution
from comfy_execution.graph import DynamicPrompt
nodes.NODE_CLASS_MAPPINGS["SparseAttn_Calibrate"] = SparseAttentionCalibrate
os.makedirs(os.path.join(OUT, "fp"))
mine = os.path.join(OUT, "fp", "mine.safetensors")
def fingerprint(recording="fp/mine.safetensors"):
    prompt = {{"1": {{"class_type": "SparseAttn_Calibrate", "inputs": {{
        "recording": recording, "method": "block_topk", "density": 0.25, "block_size": "64",
        "residual_caching": True, "anchor_steps": "", "filename_prefix": "fp/cal", "scope": "model"}}}}}}
    cache = execution.IsChangedCache("p", DynamicPrompt(prompt), None)
    return repr(asyncio.run(cache.get("1")))
r["fp_missing"] = fingerprint()
shutil.copy(path, mine)
r["fp_a"], r["fp_a_again"] = fingerprint(), fingerprint()
with open(mine, "ab") as f:  # another file at the same path (a different recording, here: other bytes)
    f.write(b"x" * 100)
r["fp_b"] = fingerprint()
r["fp_linked"] = fingerprint(["5", 1])
try:
    r["fp_direct"] = repr(SparseAttentionCalibrate.fingerprint_inputs(recording=mine))
except Exception as exc:  # ComfyNode's own fingerprint_inputs raises NotImplementedError
    r["fp_direct"] = f"{{type(exc).__name__}}: {{exc}}"
emit(r)
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("comfy-output")
    return run_in_comfyui(comfyui_path(), BODY.format(tests=str(ROOT / "tests"), out=str(out)), timeout=900)


def test_unwritable_folder_refused_before_sampling(results):
    r = results
    msg = r["blocked"]
    assert msg.startswith("ValueError: Sparse Attention Record") and r["blocked_folder"] in msg, msg
    assert "cannot write" in msg, msg
    if not r["is_root"]:
        msg = r["readonly"]
        assert msg.startswith("ValueError: Sparse Attention Record") and r["readonly_folder"] in msg, msg
        assert "cannot write" in msg, msg
    assert r["ok"] == "no error"
    assert r["probe_left"] == []  # the probe file is deleted


def test_missing_layers_refused_after_first_forward(results):
    r = results
    msg = r["missing_layers"]
    assert "Sparse Attention Record" in msg and "7, 9" in msg and "not in this model" in msg and "0-1" in msg, msg
    assert r["calls_full"] >= 4 * r["calls_refused"] > 0  # one forward of the 4-step run, not the whole run
    assert r["late_written"] is False


def test_save_failure_keeps_the_sampling_and_calibrate_says_why(results):
    r = results
    assert r["gone_kept"] == 0.0, r["gone_kept"]  # the sampler's result, unchanged by the recorder
    assert r["gone_exists"] is False
    assert any("Sparse Attention Record" in line and r["gone_path"] in line and "NOT written" in line
               for line in r["gone_log"]), r["gone_log"]
    msg = r["gone_calibrate"]
    assert msg.startswith("ValueError: Sparse Attention Calibrate") and r["gone_path"] in msg, msg
    assert "was not written" in msg and "File exists" in msg, msg
    assert "Record" in msg
    assert r["rerun_written"] is True and r["rerun_failure"] is None


def test_half_written_recording_leaves_nothing(results):
    r = results
    assert r["mid_kept"] == 0.0, r["mid_kept"]
    assert r["mid_left"] == []  # neither the file nor its partial
    assert any(r["mid_path"] in line and "Read-only file system" in line for line in r["mid_log"]), r["mid_log"]
    msg = r["mid_calibrate"]
    assert "was not written" in msg and "Read-only file system" in msg and r["mid_path"] in msg, msg


def test_calibrate_fingerprint_follows_the_recording_file(results):
    r = results
    assert r["fp_missing"] == "[None]"
    assert r["fp_a"] == r["fp_a_again"] != r["fp_missing"]
    assert r["fp_b"] != r["fp_a"]  # the file changed: ComfyUI's cache key changes, Calibrate runs again
    assert r["fp_linked"] == "[None]"  # a linked recording: the Record node's and sampler's keys decide
    assert r["fp_direct"].startswith("(")
