"""Build the two pybind11 extensions of kl_kernels.

* ``kl_kernels._C``    C++17, compiled by the host compiler: always built.
* ``kl_kernels._cuda`` CUDA, compiled by nvcc, for what this machine can use (as PyTorch's extension
  builds do): with nvcc and a visible GPU (``nvidia-smi --query-gpu=compute_cap``), that GPU's
  architecture only; without a GPU, skipped unless asked. ``KL_KERNELS_CUDA_ARCHS`` names the targets
  (``;``-separated compute capabilities; ``all`` is the release list ``80;86;89;90;100;120``) and
  builds it; ``KL_KERNELS_BUILD_CUDA=1`` builds it too (the visible GPU's arch, else the release list;
  a missing nvcc is then an error); ``KL_KERNELS_BUILD_CUDA=0`` skips it. PTX of the newest target is
  embedded too, so newer GPUs can JIT it. An entry ``compute_80`` embeds PTX only (no machine code: the
  driver compiles it on first load; a build without ptxas's time). Release wheels:
  ``KL_KERNELS_CUDA_ARCHS=all``.

* ``kl_kernels._cuda_emu`` the same CUDA sources (``csrc/cuda/*.cu`` and ``module.cpp``) compiled
  as C++ by the host compiler against the host emulation of CUDA in ``csrc/emu`` (each CUDA thread
  a fiber, real barriers and warp shuffles): the ``cuda-emulated`` backend, which runs the CUDA
  kernels on CPU tensors so that CI, which has no GPU, tests them. Built only when asked:
  ``KL_KERNELS_BUILD_CUDA_EMU=1`` (CI sets it; POSIX only: ucontext fibers, mmap'ed stacks). It is a test
  instrument (11 MB, orders of magnitude slower than the ``cpu`` kernel, never chosen by ``"auto"``), so a
  user's install and a plain ``pip wheel`` leave it out; the tests that need it skip without it.

The build talks: one line saying what it builds and how to change it, one per extension when it is done
(with its time), and one every ~30 s while a compiler runs, on stderr and on the controlling terminal too
(pip hides a build's output unless ``-v``). What it decided is written next to the extensions
(``kl_kernels/_build.json``), where ``kl-kernels info`` reads why an extension is not there.

Neither extension links libtorch, and this script never imports torch: the kernels take raw
pointers, sizes, strides and a stream, so one wheel works with any supported torch. The CUDA
runtime is linked statically, so importing ``_cuda`` needs no libcudart on the target and
no driver (the driver is only dlopen'ed by the first CUDA call).

Compilation runs in parallel: the extensions build side by side, nvcc compiles its .cu files
concurrently and, with ``--threads``, its architectures concurrently. A .cu compile whose tool was killed (the
OOM killer, on a machine short of memory) runs once more, alone; a failed one's error ends with nvcc's words and
the machine's memory and free disk.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import json
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pybind11
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

ROOT = Path(__file__).parent.resolve()
DEFAULT_CUDA_ARCHS = "80;86;89;90;100;120"


def _env_flag(name: str) -> bool | None:
    """Read a tri-state environment switch: unset/empty -> None, else a strict boolean."""
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return None
    if raw in {"1", "true", "yes", "on"}:
        return True
    if raw in {"0", "false", "no", "off"}:
        return False
    sys.exit(f"kl_kernels build: {name} must be 0 or 1, got {os.environ[name]!r}")


def _find_nvcc() -> Path | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return Path(home) / "bin" / "nvcc"
    found = shutil.which("nvcc")
    return Path(found) if found else None


def _find_cuda_home(nvcc: Path) -> Path:
    """Locate the toolkit root (headers and libcudart_static.a); nvcc may be a wrapper script."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                  str(nvcc.resolve().parent.parent), "/usr/local/cuda"]
    for cand in candidates:
        if cand and (Path(cand) / "include" / "cuda_runtime.h").exists():
            return Path(cand)
    sys.exit(f"kl_kernels build: found nvcc at {nvcc} but no CUDA toolkit (include/cuda_runtime.h); "
             "set CUDA_HOME")


def _parse_archs(spec: str) -> list[str]:
    """``'80;90'`` -> ``['80', '90']``; ``compute_NN`` entries (PTX only) keep their prefix."""
    archs = [a.strip().replace(".", "") for a in spec.replace(",", ";").split(";") if a.strip()]
    if not archs or not all(a.removeprefix("compute_").isdigit() for a in archs):
        sys.exit(f"kl_kernels build: KL_KERNELS_CUDA_ARCHS must look like '80;90' (or compute_90 for PTX only), "
                 f"got {spec!r}")
    return sorted(set(archs), key=lambda a: (int(a.removeprefix("compute_")), a))


def _cuda_arch_flags(spec: str) -> list[str]:
    archs = _parse_archs(spec)
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a.isdigit()]
    newest = archs[-1].removeprefix("compute_")
    ptx = {a.removeprefix("compute_") for a in archs if not a.isdigit()} | {newest}  # PTX for future GPUs
    flags += [f"-gencode=arch=compute_{a},code=compute_{a}" for a in sorted(ptx, key=int)]
    return flags


def _visible_gpu_archs() -> list[str]:
    """Compute capabilities of the GPUs ``nvidia-smi`` sees (``['90']``), or ``[]`` without one (no
    nvidia-smi, no driver, no device). Never torch: the build does not import it."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        res = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    if res.returncode != 0:
        return []
    caps = {line.strip().replace(".", "") for line in res.stdout.splitlines()}
    return sorted((c for c in caps if c.isdigit()), key=int)


def _cuda_plan() -> tuple[Path | None, str | None, str]:
    """What to do about ``_cuda``: ``(nvcc, arch spec, why)``; nvcc is None when it is skipped. ``why`` ends
    the build's one-line summary (what it builds and how to change it)."""
    flag = _env_flag("KL_KERNELS_BUILD_CUDA")
    archs = os.environ.get("KL_KERNELS_CUDA_ARCHS", "").strip()
    if archs.lower() == "all":
        archs = DEFAULT_CUDA_ARCHS
    if flag is False:
        return None, None, "_cuda skipped: KL_KERNELS_BUILD_CUDA=0"
    nvcc = _find_nvcc()
    if nvcc is None:
        if flag is True or archs:  # asked for: a missing nvcc is an error, not a silent skip
            asked = "KL_KERNELS_BUILD_CUDA=1" if flag is True else "KL_KERNELS_CUDA_ARCHS is set"
            sys.exit(f"kl_kernels build: {asked} but nvcc was not found (put it on PATH or set CUDA_HOME)")
        return None, None, "_cuda skipped: no nvcc (put it on PATH or set CUDA_HOME to build it)"
    if archs:
        return nvcc, archs, f"_cuda for {_parse_archs(archs)} (KL_KERNELS_CUDA_ARCHS; 'all' = {DEFAULT_CUDA_ARCHS})"
    gpus = _visible_gpu_archs()
    if gpus:
        return nvcc, ";".join(gpus), (f"_cuda for this machine's GPU ({';'.join(gpus)}); "
                                      f"KL_KERNELS_CUDA_ARCHS=all builds {DEFAULT_CUDA_ARCHS}, "
                                      "KL_KERNELS_BUILD_CUDA=0 skips it")
    if flag is True:
        return nvcc, DEFAULT_CUDA_ARCHS, (f"_cuda for {DEFAULT_CUDA_ARCHS} (KL_KERNELS_BUILD_CUDA=1, no GPU visible; "
                                          "KL_KERNELS_CUDA_ARCHS picks others)")
    return None, None, (f"_cuda skipped: nvcc found but no GPU visible (KL_KERNELS_BUILD_CUDA=1 builds it for "
                        f"{DEFAULT_CUDA_ARCHS}, {CUDA_ALL_ARCHS_TIME}; KL_KERNELS_CUDA_ARCHS=90 for one arch)")


def _announce(line: str) -> None:
    """Print one line of the build's progress on stderr and, when stderr is not a terminal (pip captures a
    build's output and shows it only with -v), on the controlling terminal too, so that a user running
    ``pip install .`` sees what is compiled and how far it is during a long, otherwise silent build.
    ``KL_KERNELS_BUILD_QUIET=1``: stderr only (scripts that run pip -q in a terminal)."""
    print(line, file=sys.stderr, flush=True)
    if os.environ.get("KL_KERNELS_BUILD_QUIET") or sys.stderr.isatty():
        return
    try:
        with open("/dev/tty", "w") as tty:
            # "\r" + erase-line: pip's spinner may stand on the line; it draws itself again after ours
            tty.write("\r\033[K" + line + "\n")
    except OSError:
        pass  # no terminal (CI, a container without one): stderr above is all there is


# Measured build times (wall clock, from scratch, `pip wheel` of a clean copy on this project's 2-core VM),
# quoted by the build's own lines; the README's install times come from the same runs.
C_TIME = "~3 minutes on 2 idle cores"
CUDA_ALL_ARCHS_TIME = "~2 more minutes on 2 idle cores"
HEARTBEAT_SECONDS = 30


class _Progress:
    """The build's progress lines: one when an extension is done (with its time), and one every
    HEARTBEAT_SECONDS naming what is still compiling, so that a build of minutes is never silent."""

    def __init__(self):
        self.start = time.monotonic()
        self.running: dict[str, float] = {}  # extension -> when it started
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def _beat(self):
        while not self.stop.wait(HEARTBEAT_SECONDS):
            with self.lock:
                running = sorted(self.running)
            if running:
                _announce(f"kl_kernels build: compiling {', '.join(running)} "
                          f"({time.monotonic() - self.start:.0f} s so far)")

    def begin(self, name: str) -> None:
        with self.lock:
            self.running[name] = time.monotonic()

    def end(self, name: str, compiled: bool) -> None:
        with self.lock:
            began = self.running.pop(name)
        if compiled:
            _announce(f"kl_kernels build: {name} built in {time.monotonic() - began:.0f} s")


def _cuda_emu_requested() -> bool:
    """Whether to build ``_cuda_emu``: only when asked (``KL_KERNELS_BUILD_CUDA_EMU=1``, which CI sets): a
    test instrument, never part of a user's install or a plain wheel."""
    flag = _env_flag("KL_KERNELS_BUILD_CUDA_EMU")
    if flag and os.name != "posix":
        sys.exit("kl_kernels build: KL_KERNELS_BUILD_CUDA_EMU=1 needs a POSIX host (ucontext, mmap)")
    return bool(flag)


# GCC's inlining budgets for the CPU loss's kernels: with GCC's defaults the per-token function
# (kl::ppo_token) stayed a call in the clamped-KL and kl_times_ratio loops of csrc/cpu/kl_penalty_cpu_impl.h,
# which then ran scalar (-fopt-info-vec: "statement clobbers memory"; ~7.5x and ~6x slower than now on 2.25M
# tokens, measured side by side; verl's low_var_kl among them). With these every variant of the loop
# vectorizes. Values and bits are unchanged: inlining neither reorders nor contracts float operations
# (-ffp-contract=off). Only these two files (each compiles in ~2 minutes instead of ~1 with them); clang
# has no such --param.
INLINE_BUDGETS = ["--param=inline-unit-growth=400", "--param=large-function-growth=400",
                  "--param=max-inline-insns-single=1000", "--param=max-inline-insns-auto=200"]
SOURCE_FLAGS = {"kl_penalty_cpu.cpp": INLINE_BUDGETS, "kl_penalty_cpu_kr.cpp": INLINE_BUDGETS}


def _clang(compiler) -> bool:
    """Whether ``compiler`` (setuptools' compiler object) calls clang for C++ sources: its own command
    (``compiler_so_cxx``, or ``compiler_so`` on setuptools without it), else the environment's."""
    import sysconfig

    command = getattr(compiler, "compiler_so_cxx", None) or getattr(compiler, "compiler_so", None)
    cc = (command[0] if command else None) or os.environ.get("CXX") or os.environ.get("CC") or \
        sysconfig.get_config_var("CXX") or "c++"
    try:
        out = subprocess.run([*shlex.split(cc)[:1], "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "clang" in out.lower()


def _compile_sources_in_parallel(compiler) -> None:
    """Make ``compiler.compile`` build one extension's C++ files side by side (setuptools compiles
    them one after another; the kernels are split into one file per dtype for this), each with its
    ``SOURCE_FLAGS``."""
    if getattr(compiler, "_kl_parallel", False):
        return
    serial = compiler.compile
    per_source = {} if _clang(compiler) else SOURCE_FLAGS

    def one(src, args, kwargs):
        extra = per_source.get(Path(src).name)
        if extra:
            kwargs = dict(kwargs, extra_postargs=[*(kwargs.get("extra_postargs") or []), *extra])
        return serial([src], *args, **kwargs)

    def compile(sources, *args, **kwargs):
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            objects = list(pool.map(lambda src: one(src, args, kwargs), sources))
        return [obj for group in objects for obj in group]

    compiler.compile = compile
    compiler._kl_parallel = True


class BuildExt(build_ext):
    """build_ext that also compiles ``.cu`` sources with nvcc, in parallel."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:  # extensions build side by side unless told otherwise
            self.parallel = max(1, os.cpu_count() or 1)

    def run(self):
        _announce(BUILD_SUMMARY)
        with _Progress() as self._progress:
            super().run()
        # A skipped _cuda (or _cuda_emu) must not survive from an earlier build (in build/ or, for
        # editable installs, next to the sources): the wheel would ship it and imports would load it.
        places = [Path(self.build_lib) / "kl_kernels"] + ([ROOT / "kl_kernels"] if self.inplace else [])
        for name in ("_cuda", "_cuda_emu"):
            if not any(ext.name == f"kl_kernels.{name}" for ext in self.extensions):
                for stale in (p for place in places for p in place.glob(f"{name}.*")):
                    print(f"removing stale {stale} ({BUILD_RECORD[name]})", flush=True)
                    stale.unlink()
        # What this build decided, next to the extensions (the wheel carries it; an editable install has it
        # in place): kl_kernels._extensions reads why an extension is missing from it.
        for place in {Path(self.get_ext_fullpath("kl_kernels._C")).parent, *places}:
            place.mkdir(parents=True, exist_ok=True)
            (place / "_build.json").write_text(json.dumps(BUILD_RECORD, indent=1) + "\n")

    def build_extension(self, ext):
        name = ext.name.split(".")[-1]
        progress = getattr(self, "_progress", None)
        if progress is None:  # (build_extension called outside run(): no progress lines)
            return self._build_extension(ext)
        progress.begin(name)
        compiled = False
        try:
            compiled = self._build_extension(ext)
        finally:
            progress.end(name, compiled)

    def _build_extension(self, ext) -> bool:
        """Build ``ext``; False when it was up to date (nothing compiled)."""
        # setuptools skips an up-to-date extension only after this method's own compiles (nvcc's, the emulated
        # build's) have run: check first, so that a rebuild (an editable reinstall, a wheel from a tree whose
        # build/ is current: .ci/wheel) recompiles nothing.
        try:
            from setuptools.modified import newer_group
        except ImportError:  # setuptools < 69
            from distutils.dep_util import newer_group
        if not self.force and not newer_group([*ext.sources, *(ext.depends or [])], self.get_ext_fullpath(ext.name),
                                              "newer"):
            _announce(f"kl_kernels build: {ext.name.split('.')[-1]} is up to date")
            return False
        _compile_sources_in_parallel(self.compiler)
        if getattr(ext, "emulated_cuda", False):
            sources, ext.sources = ext.sources, []
            ext.extra_objects = list(ext.extra_objects or []) + self._emulated_compile(ext, sources)
        cu_sources = [s for s in ext.sources if s.endswith(".cu")]
        if cu_sources:
            ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
            ext.extra_objects = list(ext.extra_objects or []) + self._nvcc_compile(ext, cu_sources)
        super().build_extension(ext)
        return True

    def _emulated_compile(self, ext, sources):
        """Every source of the emulated extension, by the host compiler with the extension's flags, the
        .cu files as C++ (``-x c++``), into their own folder: _cuda compiles module.cpp too, with other
        macros, and nvcc's objects of the .cu files live in ``nvcc/``."""
        if ".cu" not in self.compiler.src_extensions:
            self.compiler.src_extensions = [*self.compiler.src_extensions, ".cu"]
        common = dict(output_dir=str(Path(self.build_temp) / "emu"), macros=ext.define_macros,
                      include_dirs=ext.include_dirs, debug=self.debug, extra_postargs=ext.extra_compile_args,
                      depends=ext.depends)
        cu = [s for s in sources if s.endswith(".cu")]
        return (self.compiler.compile(cu, extra_preargs=["-x", "c++"], **common)
                + self.compiler.compile([s for s in sources if s not in cu], **common))

    def _nvcc_compile(self, ext, sources):
        return _nvcc_objects(ext.nvcc, sources, Path(self.build_temp) / "nvcc",
                             [f"-I{d}" for d in ext.include_dirs], ext.cuda_arch_flags)


# nvcc's words when one of its tools (cicc, ptxas) was killed, by the kernel's OOM killer mostly: the shell it runs
# them through prints "Killed" (CUDA 13) or nvcc says "'cicc' died due to signal 9"; it exits 255 either way.
NVCC_KILLED = re.compile(r"^Killed\b|died due to signal", re.MULTILINE)


def _resources(build_dir: Path) -> str:
    """The machine's memory and free disk (where nvcc writes its temporary files, where the objects go) for a
    failed compile's message: a compiler killed or out of space says little of why itself."""
    parts = []
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        kib = {k: int(v.split()[0]) for k, v in info.items() if k in ("MemAvailable", "MemTotal")}
        parts.append(f"memory: {kib['MemAvailable'] // 1024:,} MiB available of {kib['MemTotal'] // 1024:,} MiB")
    except (OSError, ValueError, KeyError, IndexError):
        pass  # no /proc (macOS): the disk alone
    for what, where in (("nvcc's temporary files", Path(tempfile.gettempdir())), ("the objects", build_dir)):
        try:
            parts.append(f"{shutil.disk_usage(where).free // 2**20:,} MiB free in {where} ({what})")
        except OSError:
            pass
    return "; ".join(parts)


def _nvcc_objects(nvcc, sources, out_dir: Path, includes, arch_flags) -> list[str]:
    """Compile ``sources`` (.cu) with nvcc into ``out_dir``, side by side, each with ``--threads`` = the cores
    (its architectures concurrently); the objects' paths. nvcc's output is printed (warnings included) and, when
    a compile fails, ends the error's message with the machine's memory and free disk. A compile whose tool was
    killed (NVCC_KILLED: on a machine short of memory the OOM killer picks a compiler) is compiled once more, alone
    and with ``--threads 1``, after the others; a compile error is never retried."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # No --use_fast_math: k3's expm1 must stay accurate near 0.
    flags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", *arch_flags]
    flags += shlex.split(os.environ.get("KL_KERNELS_NVCC_FLAGS", ""))

    def compile_one(src, threads):
        obj = out_dir / (Path(src).stem + ".o")
        cmd = [str(nvcc), "-c", src, "-o", str(obj), *includes, "--threads", str(threads), *flags]
        print("nvcc:", " ".join(cmd), flush=True)
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        if done.stdout:
            print(done.stdout, end="" if done.stdout.endswith("\n") else "\n", flush=True)
        return str(obj), done.returncode, done.stdout or ""

    def failure(src, code, output, again=False):
        tail = "\n".join(output.rstrip().splitlines()[-30:]) or "(nvcc printed nothing)"
        return (f"kl_kernels build: nvcc failed on {src} (exit {code}"
                f"{', killed again when compiled alone with --threads 1' if again else ''}):\n{tail}\n"
                f"{_resources(out_dir)}")

    threads = max(1, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, len(sources))) as pool:
        results = list(pool.map(lambda src: compile_one(src, threads), sources))
    for src, (_, code, output) in zip(sources, results):
        if code != 0 and not (code < 0 or NVCC_KILLED.search(output)):
            raise CompileError(failure(src, code, output))
    objects = []
    for src, (obj, code, output) in zip(sources, results):
        if code != 0:
            _announce(f"kl_kernels build: nvcc was killed compiling {src} (exit {code}; {_resources(out_dir)}): "
                      "compiling it again, alone, with --threads 1")
            obj, code, output = compile_one(src, 1)
            if code != 0:
                raise CompileError(failure(src, code, output, again=True))
        objects.append(obj)
    return objects


def _extensions() -> list[Extension]:
    common_includes = [pybind11.get_include(), str(ROOT / "csrc")]
    # Headers as dependencies: without them an edited header leaves stale objects behind.
    headers = sorted(str(p.relative_to(ROOT)) for pattern in ("*.h", "*.cuh") for p in (ROOT / "csrc").rglob(pattern))
    # -fno-trapping-math / -fno-math-errno change no value (no reassociation, NaN kept); they
    # give up FP exception flags and errno, which GCC otherwise protects by refusing to turn the
    # masked selects of the kernels into vector blends. -ffp-contract=off: no a*b+c fused into an FMA
    # (GCC's C++ default contracts, and the kernels' x86-64-v3 clones have FMA), so a CPU result is
    # the same float32 bits on every x86 machine, and the Triton interpreter's
    # (tests/test_triton_math_parity.py). -g0 overrides the -g of Python's own CFLAGS: debug info for
    # the template-heavy kernels was ~28% of their compile time (kl_penalty_cpu.cpp 147 -> 106 s here) and
    # most of _C's size; crashes are read on the sanitizer lane's build, which keeps -g1 (.ci/asan-fuzz).
    cxx_flags = ["-std=c++17", "-O3", "-g0", "-fvisibility=hidden", "-fno-trapping-math", "-fno-math-errno",
                 "-ffp-contract=off"]
    exts = [
        Extension(
            "kl_kernels._C",
            sources=sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cpu").glob("*.cpp")),
            include_dirs=common_includes,
            depends=headers,
            # dlopen/dl_iterate_phdr: finding the OpenMP runtime torch loaded (parallel.cpp); part of
            # libc since glibc 2.34, libdl before.
            libraries=["dl"],
            extra_compile_args=cxx_flags,
            language="c++",
        )
    ]
    nvcc, arch_spec, cuda_why = _cuda_plan()
    if nvcc is not None:
        cuda_home = _find_cuda_home(nvcc)
        lib_dirs = [d for d in (cuda_home / "lib64", cuda_home / "targets" / "x86_64-linux" / "lib")
                    if (d / "libcudart_static.a").exists()]
        if not lib_dirs:
            sys.exit(f"kl_kernels build: libcudart_static.a not found under {cuda_home}")
        cuda_ext = Extension(
            "kl_kernels._cuda",
            sources=sorted(str(p.relative_to(ROOT)) for pattern in ("*.cu", "*.cpp")
                           for p in (ROOT / "csrc" / "cuda").glob(pattern)),
            include_dirs=[*common_includes, str(cuda_home / "include")],
            # the .cu files too: nvcc compiles them outside ext.sources, so setuptools' up-to-date check of
            # the linked module would not see an edited kernel otherwise
            depends=headers + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cuda").glob("*.cu")),
            library_dirs=[str(lib_dirs[0])],
            # Static runtime: importing the module needs neither libcudart nor a driver.
            libraries=["cudart_static", "dl", "rt", "pthread"],
            extra_compile_args=cxx_flags,
            language="c++",
        )
        cuda_ext.nvcc = nvcc
        cuda_ext.cuda_arch_flags = _cuda_arch_flags(arch_spec)
        # Recorded in the module so `kl-kernels info` can say what the wheel runs on.
        cuda_ext.define_macros = [("KL_KERNELS_CUDA_ARCHS", '"%s"' % ";".join(_parse_archs(arch_spec)))]
        exts.append(cuda_ext)
    if _cuda_emu_requested():
        # The emulation's headers come first: <cuda_runtime.h> is csrc/emu/cuda_runtime.h here.
        emu_sources = sorted(str(p.relative_to(ROOT)) for d, pattern in (("cuda", "*.cu"), ("emu", "*.cu"),
                                                                         ("emu", "*.cpp"))
                             for p in (ROOT / "csrc" / d).glob(pattern)) + ["csrc/cuda/module.cpp"]
        emu_ext = Extension(
            "kl_kernels._cuda_emu",
            sources=emu_sources,
            include_dirs=[str(ROOT / "csrc" / "emu"), *common_includes],
            # every source too: they are compiled outside ext.sources (_emulated_compile), so setuptools'
            # up-to-date check of the linked module would not see an edited one otherwise
            depends=headers + emu_sources,
            libraries=["dl"],  # dladdr (the emulation's diagnostics)
            define_macros=[("KL_CUDA_MODULE", "_cuda_emu"), ("KL_KERNELS_CUDA_ARCHS", '"emulated"')],
            # -O2 -g: a test instrument; its stack traces (sanitizers, deadlock reports) should be readable.
            extra_compile_args=["-std=c++17", "-O2", "-g", "-fvisibility=hidden", "-Wno-unknown-pragmas"],
            language="c++",
        )
        emu_ext.emulated_cuda = True
        exts.append(emu_ext)
    built = ["_C"] + [e.name.split(".")[-1] for e in exts[1:]]
    emu_why = ("_cuda_emu built (KL_KERNELS_BUILD_CUDA_EMU=1)" if "_cuda_emu" in built else
               "_cuda_emu skipped: a test instrument, built only when asked (KL_KERNELS_BUILD_CUDA_EMU=1)")
    global BUILD_SUMMARY
    BUILD_SUMMARY = f"kl_kernels build: compiling {', '.join(built)} (_C: {C_TIME}); {cuda_why}"
    BUILD_RECORD.update(built=built, _cuda=cuda_why, _cuda_emu=emu_why,
                        cuda_archs=";".join(_parse_archs(arch_spec)) if nvcc is not None else None)
    return exts


BUILD_SUMMARY = ""  # set by _extensions(), printed once when the extensions are built (BuildExt.run)
# What the build decided and why (set by _extensions()), written as kl_kernels/_build.json by BuildExt.run
BUILD_RECORD: dict = {}

setup(
    packages=find_packages(include=["kl_kernels", "kl_kernels.*"]),
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExt},
)
