"""Checks that only a real GPU can answer, for ``.ci/gpu`` (run with the package importable).

    python .ci/gpu_checks.py selfcheck   each GPU backend's first-use self-check, both ops (what
                                         compute-sanitizer runs: every kernel, edge cases, NaN/inf)
    python .ci/gpu_checks.py nosync      eager calls under torch.cuda.set_sync_debug_mode("error"):
                                         any host synchronization in our path raises
    python .ci/gpu_checks.py graph       both ops captured in a CUDA graph and replayed on new data
    python .ci/gpu_checks.py race        each CUDA kernel once on multi-tile rows (what the sanitizers run)
    python .ci/gpu_checks.py hostile     bad values on CUDA tensors (issue 51), the GPU backends and torch:
                                         each bad offsets / lengths / prompt_lens / label / nested sequence
                                         lengths call returns without a device assert, the next
                                         call or kl_kernels.check_errors() raises the ValueError naming the
                                         argument, and a valid call right after matches the float64
                                         reference (the context alive); then the adversarial module's calls
                                         on CUDA tensors. Run it under compute-sanitizer --tool memcheck
                                         (.ci/gpu: 0 errors expected)

Each prints one line per case, "ok" or the reason, and exits 1 when any case failed.
"""

from __future__ import annotations

import sys
import traceback

import torch

import kl_kernels
from kl_kernels import full_kl, kl_penalty_loss, kl_reward, selfcheck, token_logprobs

import os

# A dry run on a machine without a GPU: KL_GPU_CHECKS_DEVICE=cpu KL_GPU_CHECKS_BACKENDS=cpu,torch
DEV = torch.device(os.environ.get("KL_GPU_CHECKS_DEVICE", "cuda"))
BACKENDS = tuple(os.environ.get("KL_GPU_CHECKS_BACKENDS", "cuda,triton").split(","))
# which ops the selfcheck and race modes run, in order (under compute-sanitizer each selfcheck takes a minute
# or more)
OPS = tuple(os.environ.get("KL_GPU_CHECKS_OPS", "kl_reward,kl_penalty_loss").split(","))
failed = []


def report(name, fn):
    try:
        fn()
        print(f"{name}: ok", flush=True)
    except Exception as exc:  # noqa: BLE001 - every failure is a finding to report
        failed.append(name)
        print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(limit=4)


def packed(n_seq=64, seed=0, dtype=torch.float32, long_row=0):
    """A packed batch; ``long_row`` > 0 makes row 1 that long (over 16 tiles of 2,048: the combine
    kernels sum it with the whole block, csrc/cuda/tiles.cuh)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 700, (n_seq,), generator=g)
    if long_row:
        lengths[1] = long_row
    offsets = torch.zeros(n_seq + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    lp = (-3 * torch.rand(n, generator=g)).to(dtype)
    ref = (-3 * torch.rand(n, generator=g)).to(dtype)
    mask = torch.rand(n, generator=g) < 0.8
    adv = torch.randn(n, generator=g).to(dtype)
    w = (0.5 + torch.rand(n, generator=g)).to(dtype)
    return {k: v.to(DEV) for k, v in dict(lp=lp, ref=ref, mask=mask, offsets=offsets, adv=adv, w=w).items()}


def padded(b=32, t=600, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lp = (-3 * torch.rand(b, t, generator=g)).to(dtype)
    ref = (-3 * torch.rand(b, t, generator=g)).to(dtype)
    mask = torch.rand(b, t, generator=g) < 0.8
    return {k: v.to(DEV) for k, v in dict(lp=lp, ref=ref, mask=mask).items()}


def as_list(x):
    """The packed batch as per-sequence tensors (list inputs: their lengths go host -> device)."""
    cuts = x["offsets"].cpu().tolist()
    return {"list": True, **{k: [x[k][a:b] for a, b in zip(cuts, cuts[1:])] for k in ("lp", "ref", "mask")}}


def reward_call(x, backend, **kw):
    if "list" in x:
        return kl_reward(x["lp"], x["ref"], mask=x["mask"], coef=0.1, backend=backend, **kw)
    if "offsets" in x:
        return kl_reward(x["lp"], x["ref"], mask=x["mask"], offsets=x["offsets"], coef=0.1, backend=backend, **kw)
    return kl_reward(x["lp"], x["ref"], mask=x["mask"], coef=0.1, backend=backend, **kw)


# every loss option the peers' shims use: verl's dual clip, per-token IS weights on both terms, low_var_kl's
# clamps (k3 with input (-20, 20), output (-10, 10)), GSPO's sequence ratio (a pre-pass of torch ops)
ALL_OPTIONS = dict(dual_clip=3.0, weight_kl=True, estimator="k3", clamp_input=(-20.0, 20.0),
                   clamp_output=(-10.0, 10.0), importance_sampling_level="sequence")


def loss_call(x, backend, lp=None, options=False):
    lp = x["lp"] if lp is None else lp
    kw = dict(ALL_OPTIONS, weights=x["w"]) if options else {}
    return kl_penalty_loss(lp, x["lp"].detach(), x["adv"], ref_log_probs=x["ref"], beta=0.05, mask=x["mask"],
                           offsets=x["offsets"], clip_epsilon=0.2, backend=backend, **kw)


def logits_batch(seed=4, n=300, vocab=5000):
    """Logits [N, V] (bf16, a -inf entry, ignored labels) for token_logprobs, where its Triton kernels run."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(n, vocab, device=DEV, generator=g) * 3).to(torch.bfloat16)
    x[1, 7] = float("-inf")
    y = torch.randint(0, vocab, (n,), device=DEV, generator=g)
    y[::17] = -100
    return x, y


def logprobs_call(x, y, backend, inplace=False):
    """token_logprobs forward + backward (log-probs and entropy): the gradient of the logits."""
    leaf = x.detach().clone().requires_grad_(True)
    logits = leaf * 1.0 if inplace else leaf
    out = token_logprobs(logits, y, temperature=0.7, return_entropy=True, backend=backend, inplace_backward=inplace)
    (grad,) = torch.autograd.grad(out.log_probs.sum() + 0.1 * out.entropy.sum(), leaf)
    return out, grad


def full_kl_call(x, r, backend):
    """full_kl forward + backward to both logits: (kl, grad logits, grad ref_logits)."""
    leaf, ref = x.detach().clone().requires_grad_(True), r.detach().clone().requires_grad_(True)
    kl = full_kl(leaf, ref, temperature=0.7, backend=backend)
    return (kl, *torch.autograd.grad(kl.nan_to_num(0, 0, 0).sum(), (leaf, ref)))


# the row ops' fused GPU backends
LOGPROBS_BACKENDS = tuple(b for b in BACKENDS if b in ("cuda", "triton")) or ("torch",)


def selfchecks():
    for op in OPS:
        for backend in BACKENDS:
            def one(op=op, backend=backend):
                problems = selfcheck.run(op, backend, DEV)
                if problems:
                    raise AssertionError("; ".join(problems[:8]))
            report(f"selfcheck {op} {backend}", one)


def without_sync(warm_up, call):
    """``warm_up()`` (first-use compiles and caches may synchronize legitimately), then ``call()`` with
    torch's sync debug mode raising on any host synchronization."""
    warm_up()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def warm_up_on_a_side_stream(call):
    """``call()`` twice on a side stream before a capture, as torch's CUDA-graph notes ask for autograd."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def nosync():
    for backend in BACKENDS:
        for name, x in (("packed", packed()), ("padded", padded()), ("list", as_list(packed()))):
            def fwd(x=x, backend=backend):
                without_sync(lambda: reward_call(x, backend),
                             lambda: [reward_call(x, backend, estimator=e) for e in ("k1", "k2", "k3")])
            report(f"nosync kl_reward {backend} {name}", fwd)
        x = packed()
        for options in (False, True):
            def loss(x=x, backend=backend, options=options):
                lp = x["lp"].clone().requires_grad_(True)
                step = lambda: loss_call(x, backend, lp, options).loss.backward()  # noqa: E731
                without_sync(step, step)
            report(f"nosync kl_penalty_loss fwd+bwd {backend}{' all options' if options else ''}", loss)
    for backend in LOGPROBS_BACKENDS:
        for inplace in (False, True):
            def logprobs(backend=backend, inplace=inplace):
                x, y = logits_batch()
                step = lambda: logprobs_call(x, y, backend, inplace)  # noqa: E731
                without_sync(step, step)
            report(f"nosync token_logprobs fwd+bwd {backend}{' inplace' if inplace else ''}", logprobs)
        def fullkl(backend=backend):
            (x, _), (r, _) = logits_batch(seed=7), logits_batch(seed=8)
            step = lambda: full_kl_call(x, r, backend)  # noqa: E731
            without_sync(step, step)
        report(f"nosync full_kl fwd+bwd {backend}", fullkl)


def race():
    """Each CUDA kernel once on a batch whose rows span several tiles (one row 20 tiles: the combine's
    block-wide sum and its shared-memory tree), both layouts, with the checks on the device; the row ops'
    kernels on rows of several block steps (V = 5000: 3 steps of 2,048, the last partial; their block_max /
    block_sum trees), a -inf reference entry among them: what compute-sanitizer runs (racecheck, memcheck;
    the whole self-check under racecheck did not finish in 90 s for the loss on the third H200 run). The ops
    of KL_GPU_CHECKS_OPS, in order."""
    for op in OPS:
        for backend in BACKENDS:
            if op == "kl_reward":
                for name, x in (("packed", packed(n_seq=12, long_row=40_000)), ("padded", padded(b=6, t=3000))):
                    report(f"race kl_reward {backend} {name}", lambda x=x, backend=backend: reward_call(x, backend))
            elif op == "kl_penalty_loss":
                x = packed(n_seq=12, long_row=40_000)

                def loss(x=x, backend=backend):
                    for options in (False, True):
                        lp = x["lp"].clone().requires_grad_(True)
                        torch.autograd.grad(loss_call(x, backend, lp, options).loss, lp)
                report(f"race kl_penalty_loss fwd+bwd {backend}", loss)
            elif op == "token_logprobs" and backend in LOGPROBS_BACKENDS:
                x, y = logits_batch(n=12)
                report(f"race token_logprobs fwd+bwd {backend}",
                       lambda x=x, y=y, backend=backend: logprobs_call(x, y, backend))
            elif op == "full_kl" and backend in LOGPROBS_BACKENDS:
                (x, _), (r, _) = logits_batch(seed=7, n=12), logits_batch(seed=8, n=12)
                r[2, :3000] = float("-inf")
                report(f"race full_kl fwd+bwd {backend}", lambda x=x, r=r, backend=backend: full_kl_call(x, r, backend))
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def graph():
    for backend in BACKENDS:
        def reward(backend=backend):
            x, y = packed(seed=2), packed(seed=2)
            y["lp"].uniform_(-3.0, 0.0)  # same shapes and offsets, new values
            static = {k: v.clone() for k, v in x.items()}
            reward_call(static, backend)  # warm-up outside capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = reward_call(static, backend)
            for k in static:
                static[k].copy_(y[k])
            g.replay()
            torch.cuda.synchronize()
            want = reward_call(y, backend)
            torch.testing.assert_close(out.kl, want.kl, equal_nan=True)
            torch.testing.assert_close(out.kl_sum, want.kl_sum, equal_nan=True)
        report(f"graph kl_reward {backend}", reward)

        for options in (False, True):
            def loss(backend=backend, options=options):
                # forward and backward captured together (torch.autograd.grad inside the capture), warmed up
                # on a side stream first as torch's CUDA-graph notes ask for autograd
                x, y = packed(seed=3), packed(seed=3)
                y["lp"].uniform_(-3.0, 0.0)
                y["adv"].normal_()
                static = {k: v.clone() for k, v in x.items()}

                def step():
                    lp = static["lp"].detach().requires_grad_(True)
                    torch.autograd.grad(loss_call(static, backend, lp, options).loss, lp)
                warm_up_on_a_side_stream(step)
                g = torch.cuda.CUDAGraph()
                lp = static["lp"].detach().requires_grad_(True)  # the same storage as static["lp"]
                with torch.cuda.graph(g):
                    out = loss_call(static, backend, lp, options)
                    (grad,) = torch.autograd.grad(out.loss, lp)
                for k in static:
                    static[k].copy_(y[k])
                g.replay()
                torch.cuda.synchronize()
                lp_y = y["lp"].clone().requires_grad_(True)
                want = loss_call(y, backend, lp_y, options)
                (want_grad,) = torch.autograd.grad(want.loss, lp_y)
                torch.testing.assert_close(out.loss, want.loss)
                torch.testing.assert_close(grad, want_grad)
            report(f"graph kl_penalty_loss fwd+bwd {backend}{' all options' if options else ''}", loss)
    for backend in LOGPROBS_BACKENDS:
        def logprobs(backend=backend):
            (x, y), (x2, _) = logits_batch(seed=5), logits_batch(seed=6)
            static = x.clone()
            warm_up_on_a_side_stream(lambda: logprobs_call(static, y, backend))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                leaf = static.detach().requires_grad_(True)
                out = token_logprobs(leaf, y, temperature=0.7, return_entropy=True, backend=backend)
                (grad,) = torch.autograd.grad(out.log_probs.sum() + 0.1 * out.entropy.sum(), leaf)
            static.copy_(x2)
            g.replay()
            torch.cuda.synchronize()
            want, want_grad = logprobs_call(x2, y, backend)
            torch.testing.assert_close(out.log_probs, want.log_probs, equal_nan=True)
            torch.testing.assert_close(out.entropy, want.entropy, equal_nan=True)
            torch.testing.assert_close(grad, want_grad, equal_nan=True)
        report(f"graph token_logprobs fwd+bwd {backend}", logprobs)

        def fullkl(backend=backend):
            (x, _), (r, _), (x2, _) = logits_batch(seed=9), logits_batch(seed=10), logits_batch(seed=11)
            static = x.clone()
            warm_up_on_a_side_stream(lambda: full_kl_call(static, r, backend))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                leaf = static.detach().requires_grad_(True)
                kl = full_kl(leaf, r, temperature=0.7, backend=backend)
                (grad,) = torch.autograd.grad(kl.nan_to_num(0, 0, 0).sum(), leaf)
            static.copy_(x2)
            g.replay()
            torch.cuda.synchronize()
            want, want_grad, _ = full_kl_call(x2, r, backend)
            torch.testing.assert_close(kl, want, equal_nan=True)
            torch.testing.assert_close(grad, want_grad, equal_nan=True)
        report(f"graph full_kl fwd+bwd {backend}", fullkl)


def _raises_named(arg, fn):
    """``fn`` raises a ValueError naming ``arg``, now or at check_errors() (the error word, issue 51)."""
    from kl_kernels import check_errors

    try:
        fn()
        check_errors()
    except ValueError as exc:
        if arg not in str(exc):
            raise AssertionError(f"the ValueError does not name {arg}: {exc}") from exc
        return
    raise AssertionError(f"no ValueError naming {arg}")


def hostile():
    """Bad values on CUDA tensors through the cuda and triton backends, one after another in one process:
    each must raise the named ValueError (at the next call or check_errors()), never a device-side assert,
    and a valid call after each must still match the torch reference: the CUDA context survives."""
    g = torch.Generator().manual_seed(12)
    n, lens = 12, [3, 2, 4, 3]
    lp, ref = (-2 * torch.rand(n, generator=g)).to(DEV), (-2 * torch.rand(n, generator=g)).to(DEV)
    off = torch.tensor([0, 3, 5, 9, 12], device=DEV)
    plp, pref = (-2 * torch.rand(4, 5, generator=g)).to(DEV), (-2 * torch.rand(4, 5, generator=g)).to(DEV)
    logits = torch.randn(6, 50, generator=g).to(DEV)
    labels = torch.tensor([1, 50, -100, 3, 0, 7], device=DEV)  # 50: outside [0, V = 50)
    def t(*values, dtype=torch.int64):
        return torch.tensor(values, device=DEV, dtype=dtype)

    packed_kw, padded_kw = dict(log_probs=lp, ref_log_probs=ref), dict(log_probs=plp, ref_log_probs=pref)
    reward_cases = [
        ("offsets decreasing", "offsets", dict(packed_kw, offsets=t(0, 3, 1, 9, 12))),
        ("offsets end beyond N", "offsets", dict(packed_kw, offsets=t(0, 3, 5, 9, 40))),
        ("offsets huge", "offsets", dict(packed_kw, offsets=t(0, 2 ** 62, 5, 9, 12))),
        ("offsets negative", "offsets", dict(packed_kw, offsets=t(0, -7, 5, 9, 12))),
        ("lengths above T", "lengths", dict(padded_kw, lengths=t(3, 9, 0, 2))),
        ("lengths negative", "lengths", dict(padded_kw, lengths=t(3, -4, 0, 2))),
        ("prompt_lens above", "prompt_lens", dict(packed_kw, offsets=off, prompt_lens=t(0, 9, 0, 0))),
        ("int32 offsets decreasing", "offsets", dict(packed_kw, offsets=t(0, 3, 1, 9, 12, dtype=torch.int32))),
    ]
    valid = dict(log_probs=lp, ref_log_probs=ref, offsets=off, reward=torch.ones(4, device=DEV), coef=0.1,
                 estimator="k3", reward_placement="last")
    want = kl_reward(**{k: (v.double().cpu() if torch.is_tensor(v) and v.is_floating_point() else
                            v.cpu() if torch.is_tensor(v) else v) for k, v in valid.items()}, backend="torch")
    reward_cases += [
        ("offsets end short of N", "offsets", dict(packed_kw, offsets=t(0, 3, 5, 9, 10))),
        ("int32 lengths above T", "lengths", dict(padded_kw, lengths=t(3, 9, 0, 2, dtype=torch.int32))),
    ]
    # the torch backend (the reference, and what "auto" may pick) keeps the contract too: safe offsets, no
    # device-side assertion in torch's own indexing (kl_kernels/reference_math.py)
    for backend in (*BACKENDS, "torch"):
        for name, arg, kw in reward_cases:
            def reward_case(kw=kw, arg=arg, backend=backend):
                _raises_named(arg, lambda: kl_reward(**kw, backend=backend))
                out = kl_reward(**valid, backend=backend)  # right after: the context is alive
                torch.testing.assert_close(out.reward.double().cpu(), want.reward, rtol=1e-5, atol=1e-6)
            report(f"hostile kl_reward {name} {backend}", reward_case)

            def loss_case(kw=kw, arg=arg, backend=backend):
                kw = {k: v for k, v in kw.items() if k != "prompt_lens"}
                if arg == "prompt_lens":
                    return
                _raises_named(arg, lambda: kl_penalty_loss(kw["log_probs"], kw["log_probs"],
                                                           torch.ones_like(kw["log_probs"]),
                                                           **{k: v for k, v in kw.items() if k != "log_probs"},
                                                           backend=backend).loss.backward())
                assert torch.isfinite(kl_penalty_loss(lp, lp, torch.ones_like(lp), ref_log_probs=ref, offsets=off,
                                                      backend=backend).loss)
            report(f"hostile kl_penalty_loss {name} {backend}", loss_case)

        def label_case(backend=backend):
            _raises_named("labels", lambda: token_logprobs(logits, labels, backend=backend))
            out = token_logprobs(logits, labels.clamp(0, 49), backend=backend)
            want_lp = torch.log_softmax(logits.double(), -1).gather(1, labels.clamp(0, 49)[:, None])[:, 0]
            torch.testing.assert_close(out.log_probs.double(), want_lp, rtol=1e-5, atol=1e-5)
        report(f"hostile token_logprobs label outside [0, V) {backend}", label_case)

        def linear_label_case(backend=backend):
            hidden, weight = torch.randn(6, 16, device=DEV), torch.randn(50, 16, device=DEV)
            _raises_named("labels", lambda: kl_kernels.linear_token_logprobs(hidden, weight, labels, backend=backend))
            assert kl_kernels.linear_token_logprobs(hidden, weight, labels.clamp(0, 49),
                                                    backend=backend).log_probs.isfinite().all()
        report(f"hostile linear_token_logprobs label outside [0, V) {backend}", linear_label_case)

        def nested_case(backend=backend):
            # ref_log_probs with its own offsets and another split of the same total: the error word (lengths_mismatch)
            nt = lambda ls: torch.nested.nested_tensor([x.to(DEV) for x in ls], layout=torch.jagged)  # noqa: E731
            parts = [(-torch.rand(k, generator=g)) for k in (3, 4, 5)]
            lp_nt, ref_nt = nt(parts), nt([-torch.rand(k, generator=g) for k in (4, 3, 5)])
            _raises_named("ref_log_probs", lambda: kl_reward(lp_nt, ref_nt, backend=backend))
            jag = torch.nested.nested_tensor_from_jagged(lp, t(0, 3, 1, 9, 12))  # a jagged tensor's own bad offsets
            _raises_named("log_probs.offsets()", lambda: kl_reward(jag, jag.detach(), backend=backend))
            assert kl_reward(nt(parts), nt(parts), backend=backend).kl_sum.isfinite().all()
        report(f"hostile nested lengths and offsets {backend}", nested_case)

        def no_sequence_case(backend=backend):  # offsets [1] for N > 0 tokens: refused on the host
            _raises_named("offsets", lambda: kl_reward(lp, ref, offsets=t(0), backend=backend))
            assert kl_reward(lp, ref, offsets=off, backend=backend).kl_sum.isfinite().all()
        report(f"hostile offsets of no sequence {backend}", no_sequence_case)
    _adversarial_on_cuda()


def _adversarial_on_cuda():
    """The adversarial module's calls (tests/adversarial/catalogue.py) with their tensors moved to CUDA, in
    this process one after another: each returns or raises a TypeError/ValueError (surfaced by
    check_errors() when it was recorded on the device), never anything else; then a valid call works."""
    import pathlib

    from kl_kernels import check_errors

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from adversarial import catalogue  # noqa: E402

    def to_cuda(v):
        if torch.is_tensor(v) and v.device.type == "cpu" and not v.is_nested and v.layout == torch.strided:
            return v.to(DEV)
        if isinstance(v, list) and all(torch.is_tensor(t) for t in v):
            return [to_cuda(t) for t in v]
        return v

    from adversarial.worker import OPS  # noqa: E402

    for call in catalogue.build_catalogue().values():
        def one(call=call):
            for backend in BACKENDS:
                kw = {k: to_cuda(v) for k, v in call.build().items()}
                kw.setdefault("backend", backend)
                try:
                    OPS[call.op](**kw)
                    check_errors()
                except (TypeError, ValueError) as exc:
                    if call.expect == "ok":
                        raise AssertionError(f"{backend}: a valid call raised {exc}") from exc
                except Exception as exc:  # noqa: BLE001 - anything else (a device assert above all) fails
                    if type(exc).__name__ != "BackendUnavailableError":
                        raise AssertionError(f"{backend}: {type(exc).__name__}: {exc}") from exc
                out = kl_reward(torch.zeros(3, device=DEV), torch.zeros(3, device=DEV),
                                offsets=torch.tensor([0, 3], device=DEV), backend=backend)
                assert out.kl.eq(0).all()  # the context is alive
        report(f"hostile adversarial {call.name}", one)


if __name__ == "__main__":
    {"selfcheck": selfchecks, "nosync": nosync, "graph": graph, "race": race, "hostile": hostile}[sys.argv[1]]()
    sys.exit(1 if failed else 0)
