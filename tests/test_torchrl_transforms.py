"""kl_kernels.torchrl against TorchRL 0.14.1 where TorchRL works, and against the intended
result (computed per sample in float64 below) where TorchRL fails or is wrong."""

from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch

torchrl = pytest.importorskip("torchrl")  # the `torchrl` extra
from tensordict import LazyStackedTensorDict, TensorDict, lazy_stack  # noqa: E402
from torchrl.envs.llm.transforms import kl as trl  # noqa: E402
from torchrl.envs.transforms.transforms import Compose  # noqa: E402

import kl_kernels.torchrl as ours  # noqa: E402
from torchrl_models import DenseLazyLM, TinyLM, dense_of_lazy, llm_batch  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)
LENGTHS, PROMPTS = [6, 9, 4, 1, 12], [2, 3, 1, 0, 5]


def fixed(cls):
    """The transform with its action key fixed (TorchRL reads it from the parent env otherwise)."""
    return type(cls.__name__, (cls,), {"action_key": ("tokens", "full")})


def as_list(td, key):
    return list(td.get(key, as_list=True)) if isinstance(td, LazyStackedTensorDict) else list(td.get(key).unbind(0))


def assert_same(a, b, keys, atol=1e-6):
    for key in keys:
        xs, ys = as_list(a, key), as_list(b, key)
        assert len(xs) == len(ys), key
        for i, (x, y) in enumerate(zip(xs, ys)):
            assert x.shape == y.shape, (key, i, x.shape, y.shape)
            torch.testing.assert_close(x, y, atol=atol, rtol=1e-6, msg=lambda m: f"{key}[{i}]: {m}")


# ------------------------------------------------------------------ expected values (float64, per sample)

def expected(cur, ref, mask, reward, coef):
    """Per-sample k1 KL reward: lists of [L] tensors in, lists of ([L, 1] reward, [L, 1] kl, [L, 1] ref) out."""
    out = []
    for b, (c, r, m) in enumerate(zip(cur, ref, mask)):
        kl = torch.where(m, c.double() - r.double(), 0.0)
        rw = (reward[b].double() if reward is not None else 0.0) - coef * kl.unsqueeze(-1)
        out.append((rw.expand(kl.shape[0], 1), kl.unsqueeze(-1), torch.where(m, r.double(), 0.0).unsqueeze(-1)))
    return out


def ref_rows(ref_model, data, lengths, side):
    """The reference model's log-probs of each row's valid tokens, computed as the transform does
    (on the padded rows: under left padding a row's first token follows padding, not BOS)."""
    with torch.no_grad():
        lp = ref_model.token_log_probs(data["tokens", "full"])
    return valid_rows(lp, lengths, side)


def valid_rows(x, lengths, side):
    w = x.shape[1]
    return [x[b, w - n:] if side == "left" else x[b, :n] for b, n in enumerate(lengths)]


# ------------------------------------------------------------------ KLComputation

def _klc_lazy(per_token, nan_pads=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    tds = []
    for n in LENGTHS:
        lp, ref = torch.randn(n, generator=g), torch.randn(n, generator=g)
        if nan_pads and n > 2:
            ref[-1] = float("nan")  # an alignment pad
        rw = torch.randn(n, 1, generator=g) if per_token else torch.randn(1, 1, generator=g)
        tds.append(TensorDict({("log_probs", "full"): lp, ("ref_log_probs", "full"): ref, "reward": rw}))
    return lazy_stack(tds)


@pytest.mark.parametrize("per_token", [True, False], ids=["reward-per-token", "reward-per-sequence"])
@pytest.mark.parametrize("nan_pads", [False, True], ids=["", "nan-pads"])
def test_klcomputation_equals_torchrl_on_lazy_stacks(per_token, nan_pads, monkeypatch):
    td = _klc_lazy(per_token, nan_pads)
    want = trl.KLComputation(coeff=0.3)(td.clone())
    taken = []
    in_place = ours.KLComputation._step_samples
    monkeypatch.setattr(ours.KLComputation, "_step_samples", lambda self, t: taken.append(in_place(self, t)) or taken[-1])
    got = ours.KLComputation(coeff=0.3)(td.clone())
    assert isinstance(got, LazyStackedTensorDict)
    assert_same(got, want, ["kl_penalty", "reward"])
    assert taken == [per_token]  # per-token rewards [L, 1]: the samples are read in place


@pytest.mark.parametrize("per_token", [True, False], ids=["reward-per-token", "reward-per-sequence"])
def test_klcomputation_without_tensordict_internals(per_token, monkeypatch):
    """kl_kernels._compat.tensordict's fallbacks, as on a tensordict whose internals changed: the
    public API everywhere (no in-place sample path, no C walk), TorchRL's results all the same."""
    from kl_kernels._compat import tensordict as td_compat

    monkeypatch.setattr(td_compat, "SUPPORTED", False)
    td = _klc_lazy(per_token, True)
    want = trl.KLComputation(coeff=0.3)(td.clone())
    got = ours.KLComputation(coeff=0.3)(td.clone())
    assert isinstance(got, LazyStackedTensorDict)
    assert_same(got, want, ["kl_penalty", "reward"])


def test_klcomputation_mixed_per_token_and_per_sequence_rewards():
    """A lazy stack whose samples carry a per-token reward [L, 1] or a per-sequence one [1, 1], mixed (as
    TorchRL's per-sample broadcast allows): each sample's reward is broadcast over its tokens. (The mixed
    path called ragged.token_index without the token count: a TypeError.)"""
    g = torch.Generator().manual_seed(4)
    tds, cur, ref, rewards = [], [], [], []
    for i, n in enumerate(LENGTHS):
        lp, rf = torch.randn(n, generator=g), torch.randn(n, generator=g)
        rw = torch.randn(n, 1, generator=g) if i % 2 else torch.randn(1, 1, generator=g)
        tds.append(TensorDict({("log_probs", "full"): lp, ("ref_log_probs", "full"): rf, "reward": rw}))
        cur.append(lp), ref.append(rf), rewards.append(rw)
    want = trl.KLComputation(coeff=0.3)(lazy_stack([t.clone() for t in tds]))
    got = ours.KLComputation(coeff=0.3)(lazy_stack(tds))
    assert_same(got, want, ["kl_penalty", "reward"])
    for b, (reward, _, _) in enumerate(expected(cur, ref, [torch.ones(n, dtype=torch.bool) for n in LENGTHS],
                                                rewards, 0.3)):
        torch.testing.assert_close(as_list(got, "reward")[b].double(), reward, atol=1e-6, rtol=1e-6)


def test_klcomputation_in_place_path_falls_back_on_unusual_samples():
    """Samples the in-place path does not take (strided log-probs, [L] rewards, add_to_reward with
    no reward) go the general way, with the same results or TorchRL's error."""
    td = _klc_lazy(True, nan_pads=True)
    want = trl.KLComputation(coeff=0.3)(td.clone())
    strided = td.clone()
    for sub in strided.tensordicts:
        lp = sub["log_probs", "full"]
        sub["log_probs", "full"] = torch.stack([lp, lp], 1)[:, 0]
    assert_same(ours.KLComputation(coeff=0.3)(strided), want, ["kl_penalty", "reward"])
    flat_reward = td.clone()
    for sub in flat_reward.tensordicts:
        sub["reward"] = sub["reward"].squeeze(-1)
    with pytest.raises(ValueError, match="one more dimension"):
        ours.KLComputation(coeff=0.3)(flat_reward)


def test_klcomputation_dense_without_reward_matches_torchrl_values():
    td = TensorDict({("log_probs", "full"): torch.randn(3, 5), ("ref_log_probs", "full"): torch.randn(3, 5)},
                    batch_size=(3,))
    want = trl.KLComputation(add_to_reward=False)(td.clone())["kl_penalty"]  # a nested tensor of equal rows
    got = ours.KLComputation(add_to_reward=False)(td.clone())["kl_penalty"]  # dense [B, T] (documented)
    assert not got.is_nested and got.shape == (3, 5)
    torch.testing.assert_close(got, torch.stack(want.unbind()))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("per_token", [True, False], ids=["reward-BT1", "reward-B11"])
def test_klcomputation_dense_with_reward_where_torchrl_fails(side, per_token):
    """TorchRL raises on dense inputs with a reward (nested vs dense); NaN marks the padding."""
    g = torch.Generator().manual_seed(1)
    seqs = [(torch.randn(n, generator=g), torch.randn(n, generator=g)) for n in LENGTHS]
    width = max(LENGTHS)

    def pad(xs):
        out = torch.full((len(xs), width), float("nan"))
        for b, x in enumerate(xs):
            out[b, width - len(x):] = x if side == "left" else out[b, width - len(x):]
            if side == "right":
                out[b, :len(x)] = x
        return out
    lp, ref = pad([s[0] for s in seqs]), pad([s[1] for s in seqs])
    reward = torch.randn(len(LENGTHS), width, 1, generator=g) if per_token else torch.randn(len(LENGTHS), 1, 1)
    td = TensorDict({("log_probs", "full"): lp, ("ref_log_probs", "full"): ref, "reward": reward},
                    batch_size=(len(LENGTHS),))
    with pytest.raises(Exception):
        trl.KLComputation(coeff=0.5, padding_side=side)(td.clone())
    out = ours.KLComputation(coeff=0.5, padding_side=side)(td.clone())
    kl, rw = out["kl_penalty"], out["reward"]
    assert kl.shape == (len(LENGTHS), width) and rw.shape == (len(LENGTHS), width, 1)
    valid = ~(lp.isnan() | ref.isnan())
    want_kl = torch.where(valid, lp - ref, 0.0)
    torch.testing.assert_close(kl, want_kl)
    torch.testing.assert_close(rw, reward - 0.5 * want_kl.unsqueeze(-1))


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_klcomputation_nested_inputs(layout):
    """TorchRL fails on strided nested inputs ('NestedTensorImpl doesn't support sizes') and on
    jagged nested rewards; ours reads both and writes nested results of the same layout."""
    g = torch.Generator().manual_seed(2)
    lps = [torch.randn(n, generator=g) for n in LENGTHS]
    refs = [torch.randn(n, generator=g) for n in LENGTHS]
    rws = [torch.randn(n, 1, generator=g) for n in LENGTHS]
    nest = lambda xs: torch.nested.nested_tensor(xs, layout=layout)  # noqa: E731
    td = TensorDict({("log_probs", "full"): nest(lps), ("ref_log_probs", "full"): nest(refs), "reward": nest(rws)},
                    batch_size=(len(LENGTHS),))
    out = ours.KLComputation(coeff=0.2)(td)
    kl, rw = out["kl_penalty"], out["reward"]
    assert kl.is_nested and kl.layout == layout and rw.is_nested and rw.layout == layout
    for b, (k, r) in enumerate(zip(kl.unbind(), rw.unbind())):
        torch.testing.assert_close(k, lps[b] - refs[b])
        torch.testing.assert_close(r, rws[b] - 0.2 * (lps[b] - refs[b]).unsqueeze(-1))


def test_klcomputation_errors():
    td = _klc_lazy(True)
    with pytest.raises(ValueError, match="Log-probs not found"):
        ours.KLComputation(gen_log_probs_full_key=("nope", "full"))(td.clone())
    bad = lazy_stack([TensorDict({("log_probs", "full"): torch.zeros(3), ("ref_log_probs", "full"): torch.zeros(4),
                                  "reward": torch.zeros(3, 1)})])
    with pytest.raises(ValueError, match="Sample 0 has different shapes"):
        ours.KLComputation()(bad)
    flat_reward = lazy_stack([TensorDict({("log_probs", "full"): torch.zeros(3), ("ref_log_probs", "full"): torch.zeros(3),
                                          "reward": torch.zeros(3)})])
    with pytest.raises(ValueError, match="one more dimension than the KL"):
        ours.KLComputation()(flat_reward)


# ------------------------------------------------------------------ KLRewardTransform

@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("per_token", [True, False], ids=["reward-BT1", "reward-B11"])
def test_klrewardtransform_equals_torchrl_on_padded_batches(side, per_token):
    policy, ref_model = TinyLM(seed=1), TinyLM(seed=2)
    data, nxt = llm_batch(LENGTHS, PROMPTS, policy=policy, padded=True, padding_side=side, per_token_reward=per_token)
    want = fixed(trl.KLRewardTransform)(ref_model, coef=0.2, padding_side=side)._step(data.clone(), nxt.clone())
    got = fixed(ours.KLRewardTransform)(ref_model, coef=0.2, padding_side=side)._step(data.clone(), nxt.clone())
    assert_same(got, want, ["reward", "kl_penalty", "ref_log_probs"])


def _lazy_expected(data, nxt, ref_model, coef, mask_of):
    cur = as_list(data, ("log_probs", "full"))
    with torch.no_grad():
        ref = [ref_model.token_log_probs(t) for t in as_list(data, ("tokens", "full"))]
    reward = as_list(nxt, "reward") if "reward" in nxt.keys() else None
    return expected(cur, ref, [mask_of(b) for b in range(len(cur))], reward, coef)


def _check_lazy(out, exp, with_reward=True):
    keys = (["reward"] if with_reward else []) + ["kl_penalty", "ref_log_probs"]
    for key in keys:
        got = as_list(out, key)
        for b, e in enumerate(exp):
            want = e[["reward", "kl_penalty", "ref_log_probs"].index(key)]
            assert got[b].shape == want.shape, (key, b, got[b].shape, want.shape)
            torch.testing.assert_close(got[b].double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("per_token", [True, False], ids=["reward-L1", "reward-11"])
def test_klrewardtransform_ragged_lazy_stack_where_torchrl_fails(per_token):
    policy, ref_model = TinyLM(seed=1, pad_output=False), TinyLM(seed=2, pad_output=False)
    data, nxt = llm_batch(LENGTHS, PROMPTS, policy=policy, padded=False, per_token_reward=per_token)
    with pytest.raises(Exception):
        fixed(trl.KLRewardTransform)(ref_model, coef=0.2)._step(data.clone(), nxt.clone())
    out = fixed(ours.KLRewardTransform)(ref_model, coef=0.2)._step(data.clone(), nxt.clone())
    assert isinstance(out, LazyStackedTensorDict)
    masks = as_list(data, ("masks", "all_assistant_mask"))
    _check_lazy(out, _lazy_expected(data, nxt, ref_model, 0.2, lambda b: masks[b]))


def test_klrewardtransform_leaves_the_callers_lazy_stack_alone():
    """The reference model writes its log-probs into a shallow copy of the data, never into it."""
    policy, ref_model = TinyLM(seed=1, pad_output=False), TinyLM(seed=2, pad_output=False)
    data, nxt = llm_batch(LENGTHS, PROMPTS, policy=policy, padded=False, per_token_reward=True)
    before = [t.clone() for t in as_list(data, ("log_probs", "full"))]
    ids = [id(sub["log_probs"]) for sub in data.tensordicts]
    fixed(ours.KLRewardTransform)(ref_model, coef=0.2)._step(data, nxt.clone())
    assert [id(sub["log_probs"]) for sub in data.tensordicts] == ids
    for a, b in zip(as_list(data, ("log_probs", "full")), before):
        assert torch.equal(a, b)


def test_shallow_copy_of_a_lazy_stack_is_tensordict_copy():
    from tensordict import NonTensorData

    from kl_kernels.torchrl import _io
    samples = [TensorDict({("log_probs", "full"): torch.randn(n), "reward": torch.randn(n, 1),
                           ("a", "b", "c"): torch.zeros(n)}, device="cpu") for n in (3, 0, 5)]
    td = lazy_stack(samples)
    got, want = _io.shallow_copy(td), td.copy()
    assert type(got) is type(want) and got.batch_size == want.batch_size and got.device == want.device
    assert got.stack_dim == want.stack_dim
    for new, old in zip(got.tensordicts, td.tensordicts):
        assert type(new) is TensorDict and new is not old and new["a"] is not old["a"]
        assert new["a", "b"] is not old["a", "b"] and not new.is_locked
        assert set(new.keys(True, True)) == set(old.keys(True, True))
        for key in old.keys(True, True):
            assert new.get(key) is old.get(key)  # the same tensors
    got.tensordicts[0]["log_probs", "full"] = torch.ones(3)  # a model writing its output
    got.tensordicts[1]["x"] = torch.ones(0)
    assert not torch.equal(td.tensordicts[0]["log_probs", "full"], torch.ones(3)) and "x" not in td.tensordicts[1]
    odd = lazy_stack([TensorDict({"t": torch.zeros(2), "text": NonTensorData("hi")}) for _ in range(2)])
    copied = _io.shallow_copy(odd)  # not only tensors and TensorDicts: TensorDict's own copy
    assert copied.tensordicts[0] is not odd.tensordicts[0] and copied.tensordicts[0]["t"] is odd.tensordicts[0]["t"]


def _odd_stacks():
    """(id, lazy stack, keys) pairs, each a case sample_leaves must answer alike in C and in Python."""
    from tensordict import NonTensorData

    def stack(extra=None):
        return lazy_stack([TensorDict({("log_probs", "full"): torch.randn(k), "reward": torch.randn(k, 1),
                                       **(extra or {})}, batch_size=()) for k in range(3)])

    keys = (("log_probs", "full"), "reward")
    locked_one = stack()
    locked_one.tensordicts[1].lock_()
    locked_all = stack().lock_()
    subclass = stack()
    subclass.tensordicts[2] = type("SubTD", (TensorDict,), {})({"reward": torch.zeros(2, 1)}, batch_size=())
    missing = stack()
    del missing.tensordicts[1]["reward"]
    leaf_on_path = stack()
    leaf_on_path.tensordicts[0]["log_probs"] = torch.zeros(0)
    text = stack({"t": NonTensorData("x")})
    return [
        ("plain", stack(), keys), ("three levels", stack({("a", "b", "c"): torch.ones(2)}), keys + (("a", "b", "c"),)),
        ("no keys", stack(), ()), ("empty stack", LazyStackedTensorDict(stack_dim=0), keys),
        ("one sample locked", locked_one, keys), ("stack locked", locked_all, keys),
        ("a TensorDict subclass", subclass, keys), ("a key missing", missing, keys),
        ("a leaf on the path", leaf_on_path, keys), ("a container as the value", stack(), ("log_probs",)),
        ("non-tensor data", text, keys + ("t",)),
        ("a dense stack", TensorDict({"reward": torch.zeros(3, 2, 1)}, batch_size=(3,)), ("reward",)),
        ("2-d samples", lazy_stack([TensorDict({"reward": torch.zeros(2, 1)}, batch_size=(2,))] * 2), ("reward",)),
    ]


@pytest.mark.parametrize("case", range(len(_odd_stacks())), ids=[c[0] for c in _odd_stacks()])
def test_sample_leaves_walks_alike_in_c_and_in_python(case, monkeypatch):
    from kl_kernels.torchrl import _io
    if _io._walker() is None:
        pytest.skip("the CPU extension has no walker")
    _, td, keys = _odd_stacks()[case]
    got = _io.sample_leaves(td, keys)
    monkeypatch.setattr(_io, "WALK_IN_C", False)
    want = _io.sample_leaves(td, keys)
    if want is None:
        assert got is None
        return
    assert got is not None and len(got[1]) == len(keys)
    for walked in (got, want):  # tuples, which put_entries and kl_reward's list lane take without a copy
        assert type(walked[0]) is tuple and type(walked[1]) is tuple and all(type(v) is tuple for v in walked[1])
    assert [e is w for e, w in zip(got[0], want[0])] == [True] * len(want[0]) and len(got[0]) == len(want[0])
    for g, w in zip(got[1], want[1]):
        assert len(g) == len(w) and all(a is b for a, b in zip(g, w))  # the very objects


def test_put_entries_sets_each_samples_value_in_c():
    from kl_kernels.torchrl import _io
    put = _io._putter()
    if put is None:
        pytest.skip("the CPU extension has no put_entries")
    entries = [{"a": 1}, {}, {"a": 3}]
    values = [torch.zeros(1), torch.ones(2), torch.zeros(3)]
    for sequence in (list, tuple):
        assert put(sequence(entries), "a", sequence(values)) is True
        assert [e["a"] is v for e, v in zip(entries, values)] == [True] * 3
        values = [v + 1 for v in values]
    for bad in ((entries[:2], "a", values), (entries, ("a",), values), (entries + [[]], "a", values + [1]),
                (iter(entries), "a", values), (entries, "a", torch.zeros(3)), (entries, "a", iter(values))):
        before = [dict(e) if isinstance(e, dict) else e for e in bad[0]] if isinstance(bad[0], list) else None
        assert put(*bad) is False  # nothing set: _io.put_entries then loops in Python
        if before is not None:
            assert [dict(e) if isinstance(e, dict) else e for e in bad[0]] == before


def test_put_entries_survives_a_finalizer_emptying_its_values():
    """Replacing a value frees the old one; its finalizer may change the values being stored. The C
    loop reads them in place, so it must notice (an error, never a read past the end)."""
    from kl_kernels.torchrl import _io
    put = _io._putter()
    if put is None:
        pytest.skip("the CPU extension has no put_entries")
    values = [torch.zeros(1), torch.ones(2), torch.zeros(3)]

    class EmptiesValues:
        def __del__(self):
            values.clear()

    entries = [{"a": EmptiesValues()}, {}, {}]
    with pytest.raises(ValueError, match="changed size"):
        put(entries, "a", values)
    assert type(entries[0]["a"]) is torch.Tensor and entries[1] == {} and entries[2] == {}


def test_sample_leaves_finds_what_tensordict_finds():
    from kl_kernels.torchrl import _io
    _, td, keys = _odd_stacks()[1]
    entries, leaves = _io.sample_leaves(td, keys)
    assert entries == tuple(sub._tensordict for sub in td.tensordicts)
    for key, values in zip(keys, leaves):
        assert all(v is t for v, t in zip(values, td.get(key, as_list=True)))


def test_klrewardtransform_assistant_only_false_and_missing_reward():
    """TorchRL: UnboundLocalError (assistant_only=False) and AttributeError (no reward)."""
    policy, ref_model = TinyLM(seed=1), TinyLM(seed=2)
    data, nxt = llm_batch(LENGTHS, PROMPTS, policy=policy, padded=True)
    with pytest.raises(UnboundLocalError):
        fixed(trl.KLRewardTransform)(ref_model, assistant_only=False)._step(data.clone(), nxt.clone())
    out = fixed(ours.KLRewardTransform)(ref_model, coef=0.1, assistant_only=False)._step(data.clone(), nxt.clone())
    attention = data["masks", "all_attention_mask"]
    cur = valid_rows(data["log_probs", "full"], LENGTHS, "left")
    ref = ref_rows(ref_model, data, LENGTHS, "left")
    rw = valid_rows(nxt["reward"], LENGTHS, "left")
    exp = expected(cur, ref, [torch.ones(n, dtype=torch.bool) for n in LENGTHS], rw, 0.1)
    for key, i in (("reward", 0), ("kl_penalty", 1), ("ref_log_probs", 2)):
        got = valid_rows(out[key], LENGTHS, "left")
        for b, e in enumerate(exp):
            torch.testing.assert_close(got[b].double(), e[i], atol=1e-6, rtol=1e-6)
        assert (out[key][~attention] == 0).all()

    no_reward = TensorDict({}, batch_size=nxt.batch_size)
    with pytest.raises(AttributeError):
        fixed(trl.KLRewardTransform)(ref_model)._step(data.clone(), no_reward.clone())
    out = fixed(ours.KLRewardTransform)(ref_model, coef=0.1)._step(data.clone(), no_reward.clone())
    torch.testing.assert_close(out["reward"], -0.1 * out["kl_penalty"])


@pytest.mark.parametrize("side", ["left", "right"])
def test_prompt_fallback_skips_each_sequences_prompt(side):
    """No assistant mask: count the attention mask minus the prompt. TorchRL blanks the first P
    columns, which under left padding are padding, not prompt; ours skips each row's prompt."""
    policy, ref_model = TinyLM(seed=1), TinyLM(seed=2)
    prompts = [max(PROMPTS)] * len(LENGTHS)  # a padded prompt tensor carries one width for all rows
    prompts = [min(p, n) for p, n in zip(prompts, LENGTHS)]
    data, nxt = llm_batch(LENGTHS, prompts, policy=policy, padded=True, padding_side=side, assistant_mask=False)
    out = fixed(ours.KLRewardTransform)(ref_model, coef=0.3, padding_side=side)._step(data.clone(), nxt.clone())
    p = data["tokens", "prompt"].shape[-1]
    cur = valid_rows(data["log_probs", "full"], LENGTHS, side)
    ref = ref_rows(ref_model, data, LENGTHS, side)
    masks = [torch.arange(n) >= p for n in LENGTHS]
    exp = expected(cur, ref, masks, valid_rows(nxt["reward"], LENGTHS, side), 0.3)
    got = valid_rows(out["kl_penalty"], LENGTHS, side)
    for b, e in enumerate(exp):
        torch.testing.assert_close(got[b].double(), e[1], atol=1e-6, rtol=1e-6)
    want = fixed(trl.KLRewardTransform)(ref_model, coef=0.3, padding_side=side)._step(data.clone(), nxt.clone())
    if side == "right":  # there TorchRL's column rule is the right one
        assert_same(out, want, ["kl_penalty", "reward", "ref_log_probs"])
    else:  # and here it is not: it counts prompt tokens of the shorter rows
        assert not torch.allclose(out["kl_penalty"], want["kl_penalty"])


def test_klrewardtransform_ragged_prompt_fallback():
    policy, ref_model = TinyLM(seed=1, pad_output=False), TinyLM(seed=2, pad_output=False)
    data, nxt = llm_batch(LENGTHS, PROMPTS, policy=policy, padded=False, assistant_mask=False)
    out = fixed(ours.KLRewardTransform)(ref_model, coef=0.2)._step(data.clone(), nxt.clone())
    _check_lazy(out, _lazy_expected(data, nxt, ref_model, 0.2, lambda b: torch.arange(LENGTHS[b]) >= PROMPTS[b]))


def test_detach_is_honoured():
    policy, ref_model = TinyLM(seed=1), TinyLM(seed=2)
    data, nxt = llm_batch(LENGTHS, PROMPTS, policy=policy, padded=True)
    data.set(("log_probs", "full"), data["log_probs", "full"].clone().requires_grad_())
    out = fixed(ours.KLRewardTransform)(ref_model)._step(data.clone(), nxt.clone())
    assert not out["kl_penalty"].requires_grad
    out = fixed(ours.KLRewardTransform)(ref_model, detach=False)._step(data.clone(), nxt.clone())
    assert out["kl_penalty"].requires_grad


def test_constructor_errors_match_torchrl():
    model = TinyLM()
    for cls in (trl.KLRewardTransform, ours.KLRewardTransform):
        with pytest.raises(ValueError, match="Cannot provide both"):
            cls(model, ref_model_factory=TinyLM)
        with pytest.raises(ValueError, match="Must provide exactly one"):
            cls()
        with pytest.raises(ValueError, match="configured to generate"):
            cls(TinyLM(generate=True))
        with pytest.raises(ValueError, match="input_mode"):
            cls(TinyLM(input_mode="text"))
    t = ours.KLRewardTransform(ref_model_factory=TinyLM)
    assert isinstance(t, trl.KLRewardTransform) and t.out_keys == trl.KLRewardTransform(TinyLM()).out_keys


def test_shape_mismatch_error_carries_the_eos_hint():
    policy, ref_model = TinyLM(seed=1, pad_output=False), TinyLM(seed=2, pad_output=False)
    data, nxt = llm_batch(LENGTHS, PROMPTS, policy=policy, padded=False)

    class Truncating(TinyLM):
        def forward(self, td):
            super().forward(td)
            for sub in td.tensordicts:
                sub.set(("log_probs", "full"), sub.get(("log_probs", "full"))[:-1])
            return td
    with pytest.raises(ValueError, match="padding token is identical to the eos token"):
        fixed(ours.KLRewardTransform)(Truncating(seed=2, pad_output=False))._step(data.clone(), nxt.clone())


# ------------------------------------------------------------------ RetrieveLogProb / RetrieveKL

@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "ragged"])
def test_retrievelogprob_equals_torchrl(pad_output):
    policy = TinyLM(seed=1, pad_output=pad_output)
    model = TinyLM(seed=3, pad_output=pad_output, input_mode="history", log_probs_key="ref_log_probs")
    data, _ = llm_batch(LENGTHS, PROMPTS, policy=policy, padded=pad_output)
    want = trl.RetrieveLogProb(model)(data.clone())
    got = ours.RetrieveLogProb(model)(data.clone())
    key = ("ref_log_probs", "full")
    if pad_output:
        torch.testing.assert_close(got.get(key), want.get(key))
    else:
        assert_same(got, want, [key])


def test_retrievekl_is_a_compose_of_our_transforms_and_equals_torchrl():
    gen = TinyLM(seed=1, pad_output=False, input_mode="history", log_probs_key="log_probs")
    ref = TinyLM(seed=2, pad_output=False, input_mode="history", log_probs_key="ref_log_probs")
    data, nxt = llm_batch(LENGTHS, PROMPTS, policy=gen, padded=False)
    td = data.clone()
    for sub, r in zip(td.tensordicts, nxt.tensordicts):
        sub.set("reward", r["reward"])
    t = ours.RetrieveKL(gen, ref, coeff=0.25)
    assert isinstance(t, Compose) and isinstance(t, trl.RetrieveKL)
    assert [type(x) for x in t.transforms] == [ours.RetrieveLogProb, ours.RetrieveLogProb, ours.KLComputation]
    got = t(td.clone())
    want = trl.RetrieveKL(gen, ref, coeff=0.25)(td.clone())
    assert_same(got, want, ["kl_penalty", "reward", ("ref_log_probs", "full")])


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster whose workers import this folder's modules (TinyLM). Skips without ray."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        yield ray
        return
    here, before = os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, before) if p)  # inherited by the workers
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        os.environ.pop("PYTHONPATH") if before is None else os.environ.update(PYTHONPATH=before)
    yield ray
    ray.shutdown()


def test_use_ray_service_runs_our_class_on_the_actor(ray_cluster):
    """use_ray_service=True: TorchRL's RayKLRewardTransform with our class on the remote actor, in
    an env (the actor has no parent: the local wrapper hands it the action key, without which
    TorchRL 0.14.1's own actor fails every step), giving what the local transform gives."""
    from torchrl.envs import TransformedEnv
    from torchrl.envs.llm import ChatEnv

    t = ours.KLRewardTransform(ref_model_factory=functools.partial(TinyLM, seed=2), coef=0.2, use_ray_service=True)
    assert isinstance(t, trl.RayKLRewardTransform)
    TransformedEnv(ChatEnv(batch_size=(len(LENGTHS),), input_mode="tokens"), t)
    remote_class = ray_cluster.get(t._actor.__ray_call__.remote(lambda actor: type(actor).__module__))
    assert remote_class == ours.KLRewardTransform.__module__
    data, nxt = llm_batch(LENGTHS, PROMPTS, policy=TinyLM(seed=1), padded=True, padding_side="left",
                          per_token_reward=True)
    got = t._step(data.clone(), nxt.clone())
    want = fixed(ours.KLRewardTransform)(TinyLM(seed=2), coef=0.2)._step(data.clone(), nxt.clone())
    assert_same(got, want, ["reward", "kl_penalty", "ref_log_probs"])


def test_retrievelogprob_registers_the_keys_it_writes():
    """Issue 26 item 4: in TransformedEnv(ChatEnv) the env checks every key a transform writes
    against the specs. TorchRL 0.14.1's RetrieveLogProb registers "kl_penalty" (never written) and
    not its log-probs, so building the env's specs raises KeyError; ours registers the log-probs
    ([*batch, -1], ragged like the env's token specs)."""
    from torchrl.envs import TransformedEnv
    from torchrl.envs.llm import ChatEnv

    gen = TinyLM(seed=1, pad_output=False, input_mode="history", log_probs_key="log_probs")
    ref = TinyLM(seed=2, pad_output=False, input_mode="history", log_probs_key="ref_log_probs")

    def env_of(mod):
        return TransformedEnv(ChatEnv(batch_size=(3,), input_mode="history"),
                              mod.RetrieveKL(gen, ref, coeff=0.25, add_to_reward=False))

    with pytest.raises(KeyError, match="unaccounted for"):
        env_of(trl).observation_spec
    spec = env_of(ours).observation_spec
    for key in (("log_probs", "full"), ("ref_log_probs", "full"), "kl_penalty"):
        assert key in spec.keys(True, True), key
    assert spec["ref_log_probs", "full"].shape == (3, -1)


@pytest.mark.parametrize("assistant_only", [True, False])
def test_retrievekl_in_a_chat_env_with_a_generating_policy(assistant_only):
    """Issue 26 item 4: TransformedEnv(ChatEnv(input_mode="history"), RetrieveKL(gen, ref)) stepped
    with a generating policy over two turns (the second turn's prompt is the first's full history).
    Each step's kl_penalty (ragged, per sample) equals a float64 recomputation from the two models;
    TorchRL's own RetrieveKL cannot build this env (KeyError, test above)."""
    import copy

    from torchrl.envs import TransformedEnv
    from torchrl.envs.llm import ChatEnv
    from torchrl_models import GenerativeTinyLM

    gen = TinyLM(seed=1, pad_output=False, input_mode="history", log_probs_key="log_probs")
    ref = TinyLM(seed=2, pad_output=False, input_mode="history", log_probs_key="ref_log_probs")
    gen64, ref64 = copy.deepcopy(gen).double(), copy.deepcopy(ref).double()
    env = TransformedEnv(ChatEnv(batch_size=(3,), input_mode="history"),
                         ours.RetrieveKL(gen, ref, coeff=0.25, add_to_reward=False, assistant_only=assistant_only))
    policy = GenerativeTinyLM(seed=1)
    td = env.reset(TensorDict({"query": ["hi", "hello there", "a"]}, batch_size=(3,)))
    for turn in range(2):
        td = env.step(policy(td))
        nxt = td.get("next")
        assert nxt.get(("history", "prompt")).batch_size == (3, turn + 2)
        tokens = td.get(("tokens", "full"), as_list=True)
        masks = td.get(("masks", "all_assistant_mask"), as_list=True)
        kls = nxt.get("kl_penalty", as_list=True)
        assert len(kls) == 3
        for tok, mask, kl in zip(tokens, masks, kls):
            with torch.no_grad():
                want = gen64.token_log_probs(tok) - ref64.token_log_probs(tok)
            if assistant_only:
                want = want.masked_fill(~mask, 0.0)
            assert kl.dtype == torch.float32 and kl.shape == tok.shape
            torch.testing.assert_close(kl.double(), want, atol=1e-5, rtol=1e-5)
        td = nxt


def test_klcomputation_dense_batch_with_lazily_stacked_ragged_sub_tensordicts():
    """A dense TensorDict(batch_size=(B,)) whose log-probs live in lazily stacked sub-TensorDicts
    with ragged leaves (pad_output=False storage): td.get raised 'stack expects each tensor to be
    equal size' in _io.read; TorchRL reads it with as_list=True and returns a strided nested kl."""
    torch.manual_seed(0)

    def sub():
        return lazy_stack([TensorDict({"full": torch.randn(3)}), TensorDict({"full": torch.randn(5)})])

    td = TensorDict({"a": sub(), "b": sub()}, [2])
    want = trl.KLComputation(("a", "full"), ("b", "full"), add_to_reward=False)(td.clone())["kl_penalty"]
    got = ours.KLComputation(("a", "full"), ("b", "full"), add_to_reward=False)(td.clone())["kl_penalty"]
    assert got.is_nested and got.layout == want.layout == torch.strided
    for g, w in zip(got.unbind(), want.unbind()):
        torch.testing.assert_close(g, w)


# ------------------------------------------------------------------ dense batches with ragged (lazy) storage

def dense_rows(td, key):
    """Per-sample tensors under ``key``, through lazily stacked sub-TensorDicts of a dense batch."""
    if isinstance(td, LazyStackedTensorDict):
        return list(td.get(key, as_list=True))
    key = (key,) if isinstance(key, str) else key
    x = td.get(key[0])
    if len(key) > 1:
        if isinstance(x, LazyStackedTensorDict):
            return list(x.get(key[1:], as_list=True))
        x = x.get(key[1:])
    return list(x.unbind(0))


def assert_same_dense(a, b, keys):
    for key in keys:
        xs, ys = dense_rows(a, key), dense_rows(b, key)
        assert len(xs) == len(ys), key
        for x, y in zip(xs, ys):
            assert x.shape == y.shape, (key, x.shape, y.shape)
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def _dense_lazy_batch(per_token_reward=False):
    gen = DenseLazyLM(seed=1, pad_output=False, input_mode="history", log_probs_key="log_probs")
    ref = DenseLazyLM(seed=2, pad_output=False, input_mode="history", log_probs_key="ref_log_probs")
    data, nxt = llm_batch(LENGTHS, PROMPTS, policy=gen, padded=False, per_token_reward=per_token_reward)
    return gen, ref, dense_of_lazy(data), nxt


@pytest.mark.parametrize("detach", [True, False])
@pytest.mark.parametrize("assistant_only", [True, False])
@pytest.mark.parametrize("which", ["RetrieveLogProb", "RetrieveKL"])
def test_dense_batch_with_lazy_ragged_storage_equals_torchrl(which, detach, assistant_only):
    """Issue 26 item 2: a dense TensorDict(batch_size=(B,)) holding lazily stacked sub-TensorDicts
    with ragged leaves (a pad_output=False model's storage), every detach / assistant_only pair:
    the same values and storage as TorchRL's transform."""
    gen, ref, td, _ = _dense_lazy_batch()
    if which == "RetrieveLogProb":
        def make(m):
            return m.RetrieveLogProb(ref, detach=detach, assistant_only=assistant_only)
        keys = [("ref_log_probs", "full")]
    else:
        def make(m):
            return m.RetrieveKL(gen, ref, coeff=0.25, add_to_reward=False, detach=detach,
                                assistant_only=assistant_only)
        keys = [("ref_log_probs", "full"), "kl_penalty"]
    want, got = make(trl)(td.clone()), make(ours)(td.clone())
    assert type(got.get("ref_log_probs")) is type(want.get("ref_log_probs")) is LazyStackedTensorDict
    if which == "RetrieveKL":
        assert got["kl_penalty"].is_nested and got["kl_penalty"].layout == want["kl_penalty"].layout
    assert_same_dense(got, want, keys)


def test_dense_batch_with_lazy_ragged_storage_and_a_reward_where_torchrl_fails():
    """With a per-sequence reward [B, 1, 1] on the dense batch TorchRL's KLComputation raises (a nested
    KL against a dense reward); ours adds -coeff * kl per token, the reward broadcast over each
    sequence, as TorchRL does on lazy stacks."""
    gen, ref, td, nxt = _dense_lazy_batch()
    td.set("reward", nxt.get("reward"))
    with pytest.raises(RuntimeError, match="nested"):
        trl.RetrieveKL(gen, ref, coeff=0.25)(td.clone())
    got = ours.RetrieveKL(gen, ref, coeff=0.25)(td.clone())
    lp = dense_rows(td, ("log_probs", "full"))
    masks = dense_rows(td, ("masks", "all_assistant_mask"))
    for b, (reward, kl) in enumerate(zip(got["reward"].unbind(), got["kl_penalty"].unbind())):
        ref_lp = ref.token_log_probs(dense_rows(td, ("tokens", "full"))[b]).double()
        want_kl = torch.where(masks[b], lp[b].double() - ref_lp, 0.0)
        torch.testing.assert_close(kl.double(), want_kl, atol=1e-6, rtol=1e-6)
        want_reward = nxt.get("reward")[b].double().reshape(1, 1) - 0.25 * want_kl.unsqueeze(-1)
        torch.testing.assert_close(reward.double(), want_reward, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("per_token", [False, True])
def test_klrewardtransform_on_a_dense_batch_with_lazy_ragged_storage(per_token):
    """KLRewardTransform._step on the dense batch (TorchRL's raises 'Failed to stack'): the reward
    minus coef * (lp - ref) on counted (assistant) tokens, against a float64 recomputation."""
    _, _, td, nxt = _dense_lazy_batch(per_token_reward=per_token)
    ref_model = DenseLazyLM(seed=2, pad_output=False)
    masks = dense_rows(td, ("masks", "all_assistant_mask"))
    nxt_td = lazy_stack(list(nxt.tensordicts)) if per_token else TensorDict({"reward": nxt.get("reward")}, [5])
    with pytest.raises(RuntimeError, match="stack"):
        fixed(trl.KLRewardTransform)(ref_model, coef=0.2)._step(td.clone(), nxt_td.clone())
    out = fixed(ours.KLRewardTransform)(ref_model, coef=0.2)._step(td.clone(), nxt_td.clone())
    lp = dense_rows(td, ("log_probs", "full"))
    rewards = dense_rows(out, "reward")
    for b in range(len(LENGTHS)):
        ref_lp = ref_model.token_log_probs(dense_rows(td, ("tokens", "full"))[b]).double()
        kl = torch.where(masks[b], lp[b].double() - ref_lp, 0.0)
        base = nxt.tensordicts[b]["reward"].double() if per_token else nxt.get("reward")[b].double()
        torch.testing.assert_close(rewards[b].double().reshape(-1), (base - 0.2 * kl.unsqueeze(-1)).reshape(-1),
                                   atol=1e-6, rtol=1e-6)
