"""Packaging: versions in sync, build script never imports torch, wheels carry the extensions."""

from __future__ import annotations

import ast
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

import kl_kernels
from conftest import REPO


def test_version_in_sync():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["version"] == kl_kernels.__version__


def test_build_never_imports_torch():
    for name in ("setup.py",):
        tree = ast.parse((REPO / name).read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "torch" not in imported, f"{name} imports torch"
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    assert not any(r.startswith("torch") for r in requires)


def test_no_libtorch_in_csrc():
    for path in (REPO / "csrc").rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert "torch/" not in text and "ATen" not in text, f"{path} depends on libtorch"


def _clean_copy(dest):
    """The source files a clean checkout has (tracked by git when possible), not build outputs."""
    try:
        files = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True,
                               check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        files = [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()
                 and not any(part in ("build", ".git", "dist") or part.endswith(".egg-info") for part in p.parts)
                 and p.suffix != ".so"]
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    return dest


def _wheel_names(out, env_extra, source, read=()):
    """The names in the wheel built from ``source`` with ``env_extra`` (a None value unsets the variable), and the
    text of the members named in ``read``."""
    env = {k: v for k, v in {**os.environ, **env_extra}.items() if v is not None}
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                          "-w", str(out), "-q"], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (wheel,) = out.glob("kl_kernels-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    if read:
        return names, {n: zipfile.ZipFile(wheel).read(n).decode() for n in read}
    return names


@pytest.mark.slow
def test_wheel_with_cuda_then_without(tmp_path):
    """One clean copy built twice, as a developer would: first with ``_cuda`` (when nvcc is here), then
    with KL_KERNELS_BUILD_CUDA=0 in the same tree. The second wheel must carry ``_C`` and no ``_cuda``,
    although the first build left a real one in build/ (and a stale one sits next to the sources, where
    editable installs put it). Both builds as a release wheel is built, without the emulated-CUDA test
    extension.

    Compile time is not what is checked here, so the copy starts with this checkout's own up-to-date
    ``_C`` and ``_cuda`` in build/ (setuptools skips an extension newer than its sources; CI's install
    compiled them from the same files, for sm_80 and sm_90). Without a ``_cuda`` here (a checkout built
    without CUDA), ``_cuda`` is built as PTX only for one target (``compute_80``: no ptxas, ~1 minute
    instead of ~3)."""
    src = _clean_copy(tmp_path / "src")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    build_lib = src / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}" / "kl_kernels"
    for name in ("_C", "_cuda"):
        built = REPO / "kl_kernels" / f"{name}{suffix}"
        if built.exists():
            build_lib.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(built, build_lib / f"{name}{suffix}")  # a fresh mtime: newer than the copied sources
    if shutil.which("nvcc") is not None or os.environ.get("CUDA_HOME"):
        names = _wheel_names(tmp_path / "cuda", {"KL_KERNELS_BUILD_CUDA": "1", "KL_KERNELS_CUDA_ARCHS": "compute_80",
                                                 "KL_KERNELS_BUILD_CUDA_EMU": "0"}, src)
        assert any(n.startswith("kl_kernels/_C.") and n.endswith(".so") for n in names)
        assert any(n.startswith("kl_kernels/_cuda.") and n.endswith(".so") for n in names)
        assert (build_lib / f"_cuda{suffix}").exists(), "the CUDA build should have left _cuda in build/"
    else:  # no nvcc: plant what such a build would have left
        build_lib.mkdir(parents=True, exist_ok=True)
        (build_lib / f"_cuda{suffix}").write_bytes(b"stale")
    (src / "kl_kernels" / f"_cuda{suffix}").write_bytes(b"stale")

    # a plain `pip wheel` (no KL_KERNELS_BUILD_CUDA_EMU in the environment) carries no test instrument
    names, text = _wheel_names(tmp_path / "cpu", {"KL_KERNELS_BUILD_CUDA": "0", "KL_KERNELS_BUILD_CUDA_EMU": None},
                               src, read=["kl_kernels/_build.json"])
    assert any(n.startswith("kl_kernels/_C.") and n.endswith(".so") for n in names)
    assert not any(n.startswith("kl_kernels/_cuda.") for n in names)
    assert not any(n.startswith("kl_kernels/_cuda_emu") for n in names)
    assert not any(n.startswith(("tests/", "bench/", "python_api/")) for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "the wheel carries no LICENSE"
    # the build's record says what it skipped and why, for `kl-kernels info`
    record = json.loads(text["kl_kernels/_build.json"])
    assert record["built"] == ["_C"] and record["_cuda"] == "_cuda skipped: KL_KERNELS_BUILD_CUDA=0"
    assert "KL_KERNELS_BUILD_CUDA_EMU=1" in record["_cuda_emu"]


def test_cuda_arch_spec_accepts_ptx_only_entries():
    """KL_KERNELS_CUDA_ARCHS: machine code per listed target and PTX of the newest; ``compute_NN``
    entries are PTX only; anything else fails the build with the expected form."""
    flags = _setup_function("_cuda_arch_flags")
    assert flags("80;90") == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                              "-gencode=arch=compute_90,code=compute_90"]
    assert flags("compute_80") == ["-gencode=arch=compute_80,code=compute_80"]
    assert flags("90;compute_80") == ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_80,code=compute_80",
                                      "-gencode=arch=compute_90,code=compute_90"]
    with pytest.raises(SystemExit, match="must look like"):
        flags("sm_80")


def _setup_function(name, *helpers):
    """One function of setup.py (with the ``helpers`` it calls and the module's constants), without running
    setup() (setup.py never imports torch)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    wanted = {"_parse_archs", name, *helpers}
    module = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                              or (isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted)
                              or (isinstance(n, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper()
                                                                    for t in n.targets))], type_ignores=[])
    namespace: dict = {"__file__": str(REPO / "setup.py")}
    exec(compile(module, "setup.py", "exec"), namespace)
    return namespace[name]


def _fake_tools(tmp_path, gpus=None, smi_fails=False):
    """A PATH with a fake ``nvcc`` and, when ``gpus`` is given, a fake ``nvidia-smi`` printing those compute
    capabilities (``["9.0"]``) the way ``--query-gpu=compute_cap --format=csv,noheader`` does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvcc").write_text("#!/bin/sh\nexit 0\n")
    if gpus is not None:
        body = "exit 9" if smi_fails else "\n".join(f"echo {g}" for g in gpus)
        (bin_dir / "nvidia-smi").write_text(
            '#!/bin/sh\n[ "$1" = --query-gpu=compute_cap ] && [ "$2" = --format=csv,noheader ] || exit 2\n'
            + body + "\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize("env, gpus, built, archs, says", [
    # nvcc and a GPU: that GPU's arch only (two GPUs of two kinds: both)
    ({}, ["9.0"], True, "90", "this machine's GPU (90)"),
    ({}, ["8.6", "12.0", "8.6"], True, "86;120", "this machine's GPU (86;120)"),
    # nvcc, no GPU (no nvidia-smi, or one that fails: no driver): skipped, and the line says how to build it
    ({}, None, False, None, "no GPU visible (KL_KERNELS_BUILD_CUDA=1 builds it for 80;86;89;90;100;120"),
    ({}, "fails", False, None, "no GPU visible"),
    # asked: the release list without a GPU, the GPU's arch with one; an arch list wins; all = the release list
    ({"KL_KERNELS_BUILD_CUDA": "1"}, None, True, "80;86;89;90;100;120", "KL_KERNELS_BUILD_CUDA=1, no GPU visible"),
    ({"KL_KERNELS_BUILD_CUDA": "1"}, ["8.9"], True, "89", "this machine's GPU (89)"),
    ({"KL_KERNELS_CUDA_ARCHS": "100"}, ["9.0"], True, "100", "KL_KERNELS_CUDA_ARCHS"),
    ({"KL_KERNELS_CUDA_ARCHS": "all"}, None, True, "80;86;89;90;100;120", "KL_KERNELS_CUDA_ARCHS"),
    ({"KL_KERNELS_BUILD_CUDA": "0", "KL_KERNELS_CUDA_ARCHS": "90"}, ["9.0"], False, None, "KL_KERNELS_BUILD_CUDA=0"),
])
def test_cuda_build_follows_the_machine(tmp_path, monkeypatch, env, gpus, built, archs, says):
    """setup.py builds _cuda for what this machine can use (a fake nvcc, a fake nvidia-smi): the visible GPU's
    arch; without a GPU nothing unless asked; the release list when asked without a GPU or with ``all``."""
    for var in ("CUDA_HOME", "CUDA_PATH", "KL_KERNELS_BUILD_CUDA", "KL_KERNELS_CUDA_ARCHS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    path = _fake_tools(tmp_path, gpus=None if gpus in (None, "fails") else gpus, smi_fails=gpus == "fails")
    if gpus == "fails":
        _fake_tools(tmp_path, gpus=[], smi_fails=True)
    monkeypatch.setenv("PATH", path)
    plan = _setup_function("_cuda_plan", "_env_flag", "_find_nvcc", "_visible_gpu_archs")
    nvcc, spec, why = plan()
    assert (nvcc is not None) == built, why
    assert spec == archs
    assert says in why


def test_cuda_build_without_nvcc_says_so(tmp_path, monkeypatch):
    for var in ("CUDA_HOME", "CUDA_PATH", "KL_KERNELS_BUILD_CUDA", "KL_KERNELS_CUDA_ARCHS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    nvcc, spec, why = _setup_function("_cuda_plan", "_env_flag", "_find_nvcc", "_visible_gpu_archs")()
    assert nvcc is None and "no nvcc" in why and "CUDA_HOME" in why
    monkeypatch.setenv("KL_KERNELS_CUDA_ARCHS", "90")  # asked for: an error, not a silent skip
    with pytest.raises(SystemExit, match="KL_KERNELS_CUDA_ARCHS is set but nvcc was not found"):
        _setup_function("_cuda_plan", "_env_flag", "_find_nvcc", "_visible_gpu_archs")()


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux's script (a pseudo-terminal)")
def test_the_summary_reaches_the_terminal_when_pip_hides_stderr(tmp_path):
    """pip captures a build's stdout and stderr and shows them only with -v (or on failure): the summary line
    goes to the controlling terminal as well, once. Here a pseudo-terminal (script) runs _announce with its
    stderr thrown away, as pip's capture would: the line must still reach the terminal."""
    code = ("import ast, os, sys; t = ast.parse(open('setup.py').read()); "
            "m = ast.Module(body=[n for n in t.body if isinstance(n, (ast.Import, ast.ImportFrom)) or "
            "getattr(n, 'name', '') == '_announce'], type_ignores=[]); ns = {}; "
            "exec(compile(m, 'setup.py', 'exec'), ns); "
            "ns['_announce']('kl_kernels build: the line')")
    env = {k: v for k, v in os.environ.items() if k != "KL_KERNELS_BUILD_QUIET"}
    res = subprocess.run(["script", "-qec", f"{shlex.quote(sys.executable)} -c {shlex.quote(code)} 2> /dev/null",
                          "/dev/null"], cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    # (each line starts by erasing the terminal's line: pip's spinner may stand there)
    assert res.stdout.replace("\r", "").replace("\x1b[K", "").splitlines().count("kl_kernels build: the line") == 1, \
        res.stdout


def test_the_build_says_what_it_compiles_while_it_does(monkeypatch, capsys):
    """setup.py's progress lines: one every HEARTBEAT_SECONDS naming what is still compiling, and one per extension
    when it is done, with its time (an up-to-date one says nothing more)."""
    import time

    monkeypatch.setenv("KL_KERNELS_BUILD_QUIET", "1")  # (stderr only: no terminal writes from a test)
    progress = _setup_function("_Progress", "_announce")
    progress.__init__.__globals__["HEARTBEAT_SECONDS"] = 0.05
    with progress() as p:
        p.begin("_cuda")
        p.begin("_C")
        time.sleep(0.3)
        p.end("_C", True)
        p.end("_cuda", False)
    lines = capsys.readouterr().err.splitlines()
    assert any(line.startswith("kl_kernels build: compiling _C, _cuda (") for line in lines), lines
    assert "kl_kernels build: _C built in 0 s" in lines
    assert not any("_cuda built" in line for line in lines)


def test_info_says_why_an_extension_is_missing_in_the_builds_words(monkeypatch):
    """A build without _cuda records why (kl_kernels/_build.json); `kl-kernels info` says that, not a guess:
    nvcc was there and no GPU visible is not "no nvcc"."""
    from kl_kernels import _extensions
    from kl_kernels._info import extension_status

    why = ("_cuda skipped: nvcc found but no GPU visible (KL_KERNELS_BUILD_CUDA=1 builds it for 80;86;89;90;100;120, "
           "~2 more minutes on 2 idle cores; KL_KERNELS_CUDA_ARCHS=90 for one arch)")
    monkeypatch.setattr(_extensions, "build_record", lambda: {"built": ["_C"], "_cuda": why, "cuda_archs": None})
    said = _extensions.why_missing("_cuda")
    assert said.startswith("kl_kernels._cuda is not built: the build skipped it: nvcc found but no GPU visible")
    assert extension_status({"loaded": False, "error": said}) == ("not built", said)
    monkeypatch.setattr(_extensions, "build_record", lambda: {})  # never built here: no guess at a cause
    assert "no nvcc" not in _extensions.why_missing("_cuda")


def test_forcing_cuda_without_nvcc_fails_clearly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env.update(KL_KERNELS_BUILD_CUDA="1", PATH=os.path.dirname(sys.executable))
    res = subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode != 0 and "KL_KERNELS_BUILD_CUDA=1 but nvcc was not found" in res.stderr


def test_ci_installs_the_peers_the_harness_names():
    """The integration tests skip without verl/OpenRLHF/TRL: CI must install exactly tests/peers.py's PEER_PIP
    (one command, written once there and checked here), or those tests would silently never run."""
    import peers

    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    want = peers.PEER_PIP.replace("pip install --no-deps ", "")
    assert f"pip install -q --no-deps {want}" in ci


def test_clang_is_asked_of_the_compiler_object(tmp_path, monkeypatch):
    """The inlining budgets (GCC --params) are left out for clang: the question goes to the compiler setuptools
    will call (its compiler_so_cxx, else compiler_so), not to an environment variable it may not read."""
    clang_like = tmp_path / "fake-clang++"
    clang_like.write_text("#!/bin/sh\necho 'clang version 19.0.0'\n")
    clang_like.chmod(0o755)
    gcc_like = tmp_path / "fake-g++"
    gcc_like.write_text("#!/bin/sh\necho 'g++ (GCC) 13.2.0'\n")
    gcc_like.chmod(0o755)
    clang = _setup_function("_clang")
    monkeypatch.setenv("CXX", str(gcc_like))

    class Compiler:
        compiler_so = [str(clang_like), "-fPIC"]

    assert clang(Compiler()) is True
    Compiler.compiler_so_cxx = [str(gcc_like), "-fPIC"]
    assert clang(Compiler()) is False
    assert clang(object()) is False  # no command on the object: the environment's (g++ here)
    monkeypatch.setenv("CXX", str(clang_like))
    assert clang(object()) is True


def test_gpu_prebuild_stamp_follows_the_sources_the_arch_and_the_python(tmp_path):
    """.ci/gpu uses extensions built on the CPU machine (.ci/gpu-prebuild) only when their stamp is the one the
    sources it runs give: any edit under csrc/ or to setup.py, another arch or another Python's suffix changes it,
    so a GPU run never times or tests a stale build."""
    shutil.copytree(REPO / "csrc", tmp_path / "csrc")
    shutil.copy(REPO / "setup.py", tmp_path / "setup.py")
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "gpu-prebuild", tmp_path / ".ci" / "gpu-prebuild")

    def stamp(arch="90", suffix=".cpython-312-x86_64-linux-gnu.so"):
        out = subprocess.run(["bash", str(tmp_path / ".ci" / "gpu-prebuild"), "--stamp", arch, suffix],
                             capture_output=True, text=True, check=True).stdout.strip()
        assert len(out) == 64, out
        return out

    first = stamp()
    assert stamp() == first
    assert stamp(arch="100") != first and stamp(suffix=".cpython-313-x86_64-linux-gnu.so") != first
    header = tmp_path / "csrc" / "common" / "row_math.h"
    header.write_text(header.read_text() + "\n")
    assert stamp() != first
    header.write_text((REPO / "csrc" / "common" / "row_math.h").read_text())
    assert stamp() == first
    (tmp_path / "csrc" / "cuda" / "new_kernel.cu").write_text("// a new file\n")
    assert stamp() != first


def _fake_nvcc(tmp_path, behaviour: dict[str, str]) -> Path:
    """An ``nvcc`` that logs each call (source and ``--threads``) and, per source name, behaves as told: ``ok``
    (writes the object), ``error`` (a compile error, exit 2), ``killed`` (CUDA 13 nvcc's words when the OOM
    killer took its cicc: ``Killed``, exit 255), ``killed-once`` (that, then ``ok``)."""
    log = tmp_path / "calls"
    cases = "\n".join(f"  *{name}) mode={mode} ;;" for name, mode in behaviour.items())
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f"""#!/bin/sh
src=$2; obj=$4; threads=?
prev=; for a in "$@"; do [ "$prev" = --threads ] && threads=$a; prev=$a; done
echo "$(basename "$src") $threads" >> {log}
case "$src" in
{cases}
esac
if [ "$mode" = killed-once ]; then
  if [ -e "{tmp_path}/$(basename "$src").seen" ]; then mode=ok; else touch "{tmp_path}/$(basename "$src").seen"; mode=killed; fi
fi
case $mode in
  ok) echo "a warning of $src"; : > "$obj"; exit 0 ;;
  error) echo "$src(1): error: expected an expression"; exit 2 ;;
  killed) echo "Killed"; exit 255 ;;
esac
""")
    nvcc.chmod(0o755)
    return nvcc


def _nvcc_calls(tmp_path) -> list[str]:
    return (tmp_path / "calls").read_text().splitlines()


def test_a_killed_nvcc_compiles_again_alone(tmp_path, monkeypatch, capsys):
    """The CI failure of 2026-12-02 (stop 65's second CI run): nvcc exited 255 on kl_reward_cuda.cu ~4 minutes into
    a build sharing 2 cores and 24 GiB with three torch installs, its only words a "Killed" (nvcc's when the kernel
    kills its cicc: reproduced here) lost in pip's output. A compile whose tool was killed is compiled once more,
    alone with --threads 1, after the others; the build says so with the machine's memory and disk, and goes on."""
    monkeypatch.setenv("KL_KERNELS_BUILD_QUIET", "1")
    monkeypatch.delenv("KL_KERNELS_NVCC_FLAGS", raising=False)
    nvcc = _fake_nvcc(tmp_path, {"a.cu": "ok", "b.cu": "killed-once", "c.cu": "ok"})
    objects = _setup_function("_nvcc_objects", "_resources", "_announce")(
        nvcc, ["a.cu", "b.cu", "c.cu"], tmp_path / "out", ["-Iinc"], ["-gencode=arch=compute_90,code=sm_90"])
    assert objects == [str(tmp_path / "out" / f"{n}.o") for n in "abc"]
    assert all(Path(o).exists() for o in objects)
    threads = str(max(1, os.cpu_count() or 1))
    calls = _nvcc_calls(tmp_path)
    assert sorted(calls[:3]) == [f"{n}.cu {threads}" for n in "abc"] and calls[3:] == ["b.cu 1"]
    out = capsys.readouterr()
    assert "a warning of a.cu" in out.out  # nvcc's own words still reach the log
    said = [line for line in out.err.splitlines() if "killed" in line]
    assert len(said) == 1 and said[0].startswith("kl_kernels build: nvcc was killed compiling b.cu (exit 255; ")
    assert "again, alone, with --threads 1" in said[0] and "MiB free in" in said[0]


@pytest.mark.parametrize("behaviour, calls, says", [
    # a compile error: its words and the machine's state end the message; nothing is compiled again
    ({"a.cu": "error", "b.cu": "killed"}, 2, r"nvcc failed on a\.cu \(exit 2\):\na\.cu\(1\): error: expected an "
                                               r"expression\n.*MiB free in"),
    # killed alone too: the build fails, saying so
    ({"a.cu": "ok", "b.cu": "killed"}, 3, r"nvcc failed on b\.cu \(exit 255, killed again when compiled alone with "
                                          r"--threads 1\):\nKilled\n.*MiB free in"),
], ids=["compile-error", "killed-twice"])
def test_a_failed_nvcc_says_why_at_the_end(tmp_path, monkeypatch, behaviour, calls, says):
    """pip shows a failed build's last lines: the error's message carries nvcc's words (not only its exit code, as
    CalledProcessError did) and the memory and free disk, which tell an OOM kill or a full /tmp from a bug."""
    monkeypatch.setenv("KL_KERNELS_BUILD_QUIET", "1")
    nvcc = _fake_nvcc(tmp_path, behaviour)
    compile_all = _setup_function("_nvcc_objects", "_resources", "_announce")
    with pytest.raises(Exception, match=says) as failed:
        compile_all(nvcc, sorted(behaviour), tmp_path / "out", [], [])
    assert type(failed.value).__name__ == "CompileError"
    assert len(_nvcc_calls(tmp_path)) == calls
