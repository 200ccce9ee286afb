"""Rollout engine against plain transformers: greedy tokens, log-probs under teacher forcing,
continuous batching, sparse mode, stop handling, seeds and weight refresh (CPU, float32, tiny models)."""

import copy

import pytest
import torch

from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.modelinit import ModelInitConfig, init_model
from sparse_rl.rl.rollout import RolloutEngine, SamplingParams, make_generate_fn, process_logits
from sparse_rl.sparse.config import SparseConfig
from sparse_rl.sparse.convert import ConvertConfig, convert
from sparse_rl.sparse.layer import set_topk
from sparse_rl.sparse.loader import load_model, load_tokenizer, set_attention

LENGTHS = (5, 11, 3, 14, 8)
TOPK = 12  # below the sequence lengths used here, so sparse mode really selects


def _dir(root, arch, selector="indexer"):
    init_model(root / "dense", ModelInitConfig(arch=arch, size="tiny", seed=1))
    sc = (SparseConfig(topk=TOPK, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
          if selector == "indexer" else
          SparseConfig(selector="block", block_size=4, topk_blocks=3, sink_blocks=1, recent_blocks=1, dense_layers=[0]))
    convert(root / "dense", root / "sparse", ConvertConfig(sparse=sc, seed=3))
    return root / "sparse"


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_dir(request, tmp_path_factory):
    return _dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _dir(tmp_path_factory.mktemp("llama-r"), "llama")


def _prompts(seed=0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in lengths]


def _engine(model, max_batch=2, **kw):
    return RolloutEngine(model, None, max_batch=max_batch, max_seq_len=96, eos_token_ids=[], **kw)


def _hf_greedy(model, prompt, new):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _teacher_forced(model, c, params):
    ids = torch.tensor([c.prompt_tokens + c.tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(c.prompt_tokens) - 1:-1]
    return process_logits(logits, params).gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]


def test_greedy_equals_hf_generate(arch_dir):
    """More prompts than slots, different lengths: continuous batching, token for token."""
    model = load_model(arch_dir, attention="dense")
    prompts = _prompts()
    outs = _engine(model).generate(prompts, SamplingParams(temperature=0, max_new_tokens=24))
    assert [c.prompt_index for c in outs] == list(range(len(prompts)))
    for p, c in zip(prompts, outs):
        assert c.tokens == _hf_greedy(model, p, 24)
        assert c.finish_reason == "length"


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_logprobs_equal_teacher_forced_forward(llama_dir, mode):
    """mu = log-prob under the processed distribution (temperature, top-k, top-p), in both modes;
    the HF reference runs the same attention (sparse_rl's registered sparse path in sparse mode)."""
    model = load_model(llama_dir, attention=mode)
    params = SamplingParams(samples=2, temperature=0.7, top_k=60, top_p=0.9, max_new_tokens=30, seed=3)
    outs = _engine(model, max_batch=3).generate(_prompts(1), params)
    assert len(outs) == 2 * len(LENGTHS)
    for c in outs:
        assert len(c.logprobs) == len(c.tokens) == 30
        ref = _teacher_forced(model, c, params)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)
    if mode == "sparse":  # selection is active: the dense model gives other log-probs for these tokens
        set_attention(model, "dense")
        dense = torch.cat([_teacher_forced(model, c, params) for c in outs])
        assert (dense - torch.tensor([x for c in outs for x in c.logprobs])).abs().max() > 1e-3


@pytest.mark.parametrize("select", [None, "auto"])
def test_sparse_engine_on_triton_kernels_equals_reference_forward(llama_dir, monkeypatch, select):
    """The engine's sparse decode on the Triton kernels (interpreter on the CPU): the indexer's
    per-token step (`ops.indexer_decode`), the decode select and the sparse decode attention give
    the log-probs of a teacher-forced forward on the PyTorch reference ops. With fused projections, the
    CUDA default: the kernels read q/k/v and the indexer's inputs as column views of one GEMM's output,
    and `ops.silu_mul` runs the MLP. The engine's default select (ENGINE_SELECT: cuda, whose CPU form is its
    PyTorch reference after the interpreted score pass) and, as engine options (`runner_options`), the kernel's auto
    (row at these sizes: no cuda select runs) with `skinny_gemm` (down_proj and the fused q/k/v as
    `ops.skinny_linear`)."""
    from sparse_rl.rl.rollout import forward
    from sparse_rl.sparse.ops.indexer_topk import decode_cuda
    from sparse_rl.sparse.ops.indexer_topk.decode_select import DecodeSelect

    model = load_model(llama_dir, attention="sparse")
    # 6 new tokens take every row (9-14 prompt tokens) past the top-k of 12; each step costs seconds
    # under the interpreter
    params = SamplingParams(temperature=0.7, max_new_tokens=6, seed=5)
    calls, gemms = [], []
    real, real_gemm = decode_cuda.row_select_naive, forward.skinny_linear
    monkeypatch.setattr(decode_cuda, "row_select_naive", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(forward, "skinny_linear", lambda *a, **k: gemms.append(1) or real_gemm(*a, **k))
    monkeypatch.setenv("SPARSE_RL_BACKEND", "triton")
    opts = {} if select is None else {"decode_select": DecodeSelect(select), "skinny_gemm": ("down_proj", "qkv")}
    outs = _engine(model, max_batch=2, fuse_projections=True, runner_options=opts).generate(
        _prompts(2, lengths=(14, 9, 13)), params)
    monkeypatch.setenv("SPARSE_RL_BACKEND", "torch")
    assert bool(calls) == (select is None) and bool(gemms) == (select == "auto")
    for c in outs:
        assert len(c.tokens) == 6
        torch.testing.assert_close(torch.tensor(c.logprobs), _teacher_forced(model, c, params), atol=1e-4, rtol=0)


def test_sparse_with_topk_above_length_equals_dense(llama_dir):
    model = load_model(llama_dir, attention="sparse")
    set_topk(model, 200)
    eng = _engine(model)
    p = SamplingParams(temperature=0, max_new_tokens=30)
    sparse = eng.generate(_prompts(2), p)
    eng.set_attention("dense")
    dense = eng.generate(_prompts(2), p)
    for a, b in zip(sparse, dense):
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_continuous_batching_equals_one_at_a_time(llama_dir, mode):
    model = load_model(llama_dir, attention=mode)
    prompts = _prompts(3, (9, 2, 15, 6))
    p = SamplingParams(temperature=0, max_new_tokens=24)  # 15 + 24 tokens: well past the top-k of 12
    batched = _engine(model, max_batch=2).generate(prompts, p)
    single = _engine(model, max_batch=1)
    for pr, c in zip(prompts, batched):
        alone = single.generate([pr], p)[0]
        assert c.tokens == alone.tokens
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)


def test_seeded_sampling_is_batch_invariant(llama_dir):
    model = load_model(llama_dir, attention="dense")
    prompts = _prompts(4, (5, 11, 3))
    p = SamplingParams(samples=3, temperature=1.0, max_new_tokens=12, seed=7)
    a = _engine(model, max_batch=3).generate(prompts, p)
    b = _engine(model, max_batch=8).generate(prompts, p)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert len({tuple(c.tokens) for c in a}) == len(a)  # the n samples differ
    other = _engine(model, max_batch=8).generate(prompts, SamplingParams(samples=3, max_new_tokens=12, seed=8))
    assert [c.tokens for c in other] != [c.tokens for c in a]


def test_dense_index_decode_path_equals_sdpa(llama_dir):
    """The CUDA dense decode path (split-K kernel over every visible position) on its reference."""
    model = load_model(llama_dir, attention="dense")
    p = SamplingParams(temperature=0, max_new_tokens=25)
    ref = _engine(model).generate(_prompts(5), p)
    eng = _engine(model)
    eng.runner.dense_impl = "index"
    got = eng.generate(_prompts(5), p)
    for a, b in zip(ref, got):
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_block_selector_logprobs(tmp_path):
    d = _dir(tmp_path, "llama", selector="block")
    model = load_model(d, attention="sparse")
    params = SamplingParams(temperature=0.8, max_new_tokens=20, seed=1)
    outs = _engine(model).generate(_prompts(6, (7, 13, 3)), params)
    for c in outs:
        torch.testing.assert_close(torch.tensor(c.logprobs), _teacher_forced(model, c, params), atol=1e-4, rtol=0)


def test_eos_and_stop_strings(llama_dir):
    model = load_model(llama_dir, attention="dense")
    tok = load_tokenizer(llama_dir)
    prompt = _prompts(7, (6,))
    free = RolloutEngine(model, tok, max_batch=2, max_seq_len=96, eos_token_ids=[]).generate(
        prompt, SamplingParams(temperature=0, max_new_tokens=30))[0]
    k = 10
    eos = free.tokens[k]
    first = free.tokens.index(eos)
    eng = RolloutEngine(model, tok, max_batch=2, max_seq_len=96, eos_token_ids=[eos])
    c = eng.generate(prompt, SamplingParams(temperature=0, max_new_tokens=30))[0]
    assert c.finish_reason == "stop" and c.tokens == free.tokens[:first + 1]
    # a stop string: cut from the text, generation ends at the token that completes it
    text = tok.decode(free.tokens, skip_special_tokens=True)
    # a clean two-character piece from the second half of the text
    start = next(i for i in range(len(text) // 2, len(text) - 1)
                 if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    c = RolloutEngine(model, tok, max_batch=2, max_seq_len=96, eos_token_ids=[]).generate(
        prompt, SamplingParams(temperature=0, max_new_tokens=30, stop=[stop]))[0]
    assert c.finish_reason == "stop" and stop not in c.text and c.text == text[:text.find(stop)]
    assert c.tokens == free.tokens[:len(c.tokens)] and len(c.tokens) < 30
    # the cache bounds the sequence: finish "length" when the row is full
    short = RolloutEngine(model, tok, max_batch=2, max_seq_len=12, eos_token_ids=[])
    c = short.generate(prompt, SamplingParams(temperature=0, max_new_tokens=30))[0]
    assert c.finish_reason == "length" and len(c.tokens) == 12 - 6


@pytest.mark.parametrize("fuse", [False, True])
def test_weight_refresh_state_dict_and_lora(llama_dir, tmp_path, fuse):
    """GRPO syncs the policy (load_state_dict) and the distilled adapter (load_lora) into the engine every
    step. With fused projections both write the modules' parameters in place, i.e. into the fused GEMMs'
    buffers: the groups stay valid (nothing re-concatenated) and the outputs follow."""
    peft = pytest.importorskip("peft")
    model = load_model(llama_dir, attention="dense")
    eng = _engine(copy.deepcopy(model), fuse_projections=fuse)
    fused = eng.runner.fused_layers or []
    assert bool(fused) == fuse
    p = SamplingParams(temperature=0, max_new_tokens=20)
    prompts = _prompts(8, (6, 9))
    eng.generate(prompts, p)
    # full state dict from another model, in place
    init_model(tmp_path / "other", ModelInitConfig(arch="llama", size="tiny", seed=5))
    other = load_model(tmp_path / "other")
    eng.load_state_dict(other.state_dict())
    assert all(fl.valid() for fl in fused)
    for pr, c in zip(prompts, eng.generate(prompts, p)):
        assert c.tokens == _hf_greedy(other, pr, 20)
    # LoRA from a peft model (random B so the adapter changes the output)
    eng.load_state_dict(model.state_dict())
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "up_proj"],
                          init_lora_weights=False)
    pm = peft.get_peft_model(copy.deepcopy(model), cfg)
    assert eng.load_lora(pm) == 4 * len(model.model.layers)
    assert all(fl.valid() for fl in fused)
    got = eng.generate(prompts, p)
    with torch.no_grad():
        for pr, c in zip(prompts, got):
            assert c.tokens == _hf_greedy(pm, pr, 20)
    assert any(c.tokens != _hf_greedy(model, pr, 20) for pr, c in zip(prompts, got))
    # an engine over the peft model itself runs the adapters live (and refuses to merge into them); its
    # wrapped projections keep their own GEMMs
    live = _engine(pm, fuse_projections=fuse)
    if fuse:
        assert live.runner.fused_layers[0].qkv is None and live.runner.fused_layers[0].gate_up is None
    assert [c.tokens for c in live.generate(prompts, p)] == [c.tokens for c in got]
    with pytest.raises(SparseRLError, match="itself a LoRA layer"):
        live.load_lora(pm)
    # the same adapter as a state dict (peft key names), merged onto the engine's base weights
    eng2 = _engine(copy.deepcopy(model), fuse_projections=fuse)
    eng2.load_lora(peft.get_peft_model_state_dict(pm), scaling=8 / 4)
    assert [c.tokens for c in eng2.generate(prompts, p)] == [c.tokens for c in got]
    eng2.load_lora(peft.get_peft_model_state_dict(pm), scaling=8 / 4)  # idempotent: W = W_base + delta
    assert [c.tokens for c in eng2.generate(prompts, p)] == [c.tokens for c in got]
    if fuse:  # a peft wrap of the engine's own model after it was built: found, unfused, adapters live
        wrapped = peft.get_peft_model(eng.model, cfg)
        assert not eng.runner.fused_layers[0].valid()
        with torch.no_grad():
            for pr, c in zip(prompts, eng.generate(prompts, p)):
                assert c.tokens == _hf_greedy(wrapped, pr, 20)
        assert eng.runner.fused_layers[0].qkv is None and eng.runner.fused_layers[0].valid()


def test_make_generate_fn_is_greedy_text(llama_dir):
    """The helper other stages (eval niah) call: greedy texts, one per prompt."""
    fn = make_generate_fn(llama_dir, attention="sparse", device="cpu", max_batch=2)
    texts = fn(["hello there", "1+1=", "abc"], 8)
    model = load_model(llama_dir, attention="sparse")
    tok = load_tokenizer(llama_dir)
    eos = list(model.generation_config.eos_token_id)
    for q, t in zip(["hello there", "1+1=", "abc"], texts):
        ids = tok(q)["input_ids"]
        ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=eos,
                             pad_token_id=tok.pad_token_id)[0, len(ids):]
        assert t == tok.decode(ref, skip_special_tokens=True)


def test_generate_restores_training_mode(llama_dir):
    model = load_model(llama_dir, attention="dense")
    model.train()
    _engine(model).generate(_prompts(9, (4,)), SamplingParams(temperature=0, max_new_tokens=3))
    assert model.training


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.0, 0, 1.0), (1.0, 10, 1.0)])
def test_triton_sampler_equals_torch_sampler(temperature, top_k, top_p):
    """The fused Triton sampler (interpreter on the CPU) draws the PyTorch path's tokens and log-probs:
    rows with -inf logits, a vocabulary not a multiple of the block, temperature 1 / 0.7 / greedy;
    with top-k filtering both backends take the PyTorch path."""
    from sparse_rl.rl.rollout.sampler import Sampler

    g = torch.Generator().manual_seed(4)
    R, V = 6, 1001
    x = torch.randn(R, V, generator=g) * 3
    x[2, :500] = float("-inf")
    s = Sampler(V, "cpu")
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=9)
    rids, steps = [3, 1, 4, 1, 5, 9], [0, 7, 7, 2, 100, 3]
    t0, l0 = s.sample(x, p, rids, steps, backend="torch")
    t1, l1 = s.sample(x, p, rids, steps, backend="triton")
    assert torch.equal(t0, t1) and t1.dtype == torch.int64
    torch.testing.assert_close(l1, l0, atol=2e-6, rtol=0)
    assert bool((x[2, t1[2]] > float("-inf")))


def test_sampler_backend_choice_and_fallback(monkeypatch):
    """SPARSE_RL_SAMPLER picks the sampler (a bad value is a one-line usage error); a fused kernel
    that fails to build leaves the reason in `triton_error`, warns once, and the PyTorch path draws."""
    import sparse_rl.rl.rollout.sampler_triton as st
    from sparse_rl.errors import UsageError
    from sparse_rl.rl.rollout.sampler import Sampler

    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    s, p = Sampler(50, "cpu"), SamplingParams(seed=2)
    ref = s.sample(x, p, [0, 1, 2], [0, 0, 0], backend="torch")
    monkeypatch.setenv("SPARSE_RL_SAMPLER", "fast")
    with pytest.raises(UsageError, match="SPARSE_RL_SAMPLER"):
        s.sample(x, p, [0, 1, 2], [0, 0, 0])
    monkeypatch.setenv("SPARSE_RL_SAMPLER", "triton")

    def broken(*a, **k):
        raise RuntimeError("no kernel here\nsecond line")

    monkeypatch.setattr(st, "sample_triton", broken)
    with pytest.warns(UserWarning, match="no kernel here"):
        got = s.sample(x, p, [0, 1, 2], [0, 0, 0])
    assert s.triton_error == "RuntimeError: no kernel here"
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_row_keys_vectorised_equal_the_scalar_hash():
    """The per-row keys (vectorised) are murmur3's finaliser chained over (seed, request, step) as in
    the scalar `_fmix32_int`, so seeded completions stay what they were."""
    from sparse_rl.rl.rollout.sampler import _fmix32_int, row_keys

    def scalar(seed, r, t):
        k = _fmix32_int(_fmix32_int(_fmix32_int(seed) ^ r) ^ t)
        return k - (1 << 32) if k >= 1 << 31 else k

    g = torch.Generator().manual_seed(0)
    for seed in (0, 7, 2**31 - 1, 123456789):
        rids = torch.randint(0, 10**6, (65,), generator=g).tolist() + [2**32 + 5]
        steps = torch.randint(0, 40000, (66,), generator=g).tolist()
        got = row_keys(seed, rids, steps)
        assert got.dtype == torch.int32 and got.tolist() == [scalar(seed, r, t) for r, t in zip(rids, steps)]
    assert row_keys(1, [], []).shape == (0,)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eos_at_different_steps_with_steps_in_flight(llama_dir, temperature):
    """The decode loop launches each step before reading the previous one, on the guess that every
    sequence goes on: sequences that stop on EOS mid-batch (with and without prompts waiting) must
    still end exactly where one-at-a-time generation ends them, with the same tokens and log-probs."""
    model = load_model(llama_dir, attention="dense")
    prompts = _prompts(3, (5, 9, 4, 12, 7, 6, 10))
    p = SamplingParams(temperature=temperature, max_new_tokens=25, seed=11)
    free = RolloutEngine(model, None, max_batch=1, max_seq_len=96, eos_token_ids=[]).generate(prompts, p)
    # an EOS id that several completions hit at different steps
    counts: dict[int, int] = {}
    for c in free:
        for t in set(c.tokens[2:20]):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)
    assert counts[eos] >= 2
    one = RolloutEngine(model, None, max_batch=1, max_seq_len=96, eos_token_ids=[eos]).generate(prompts, p)
    for B in (3, 7):
        many = RolloutEngine(model, None, max_batch=B, max_seq_len=96, eos_token_ids=[eos]).generate(prompts, p)
        for a, b in zip(one, many):
            assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
    assert sum(c.finish_reason == "stop" for c in one) >= 2


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_fused_projections_keep_outputs_and_follow_weight_updates(arch_dir, mode, tmp_path):
    """One GEMM for q/k/v (+ the indexer's projections) and one for gate/up (qwen2: with biases): the
    greedy tokens still equal HF generate, log-probs a teacher-forced forward; the modules' parameters
    are views of the concatenated buffers, so an in-place update is seen, a replaced parameter is
    concatenated again at the next generation, and the model still saves and reloads."""
    model = load_model(arch_dir, attention=mode)
    eng = _engine(model, max_batch=3, fuse_projections=True)
    attn = model.model.layers[1].self_attn
    fl = eng.runner.fused_layers[1]
    assert fl.qkv is not None and fl.gate_up is not None and fl.silu
    assert len(fl.qkv.sizes) == 6 and attn.k_proj.weight.data_ptr() == fl.qkv.weight[fl.qkv.sizes[0]].data_ptr()
    prompts = _prompts(9, (6, 13, 4))
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    hf = [_hf_greedy(model, pr, 16) for pr in prompts]
    assert [c.tokens for c in eng.generate(prompts, greedy)] == hf
    eng.runner.qkv_weight_left = True  # the q/k/v(+indexer) GEMM as W @ x^T: the same tokens
    assert [c.tokens for c in eng.generate(prompts, greedy)] == hf
    eng.runner.qkv_weight_left = False
    assert eng.runner.fused_layers[1].qkv.weight.shape[0] % 64 == 0  # QKV_PAD: zero rows up to 64 columns
    eng.runner.set_qkv_pad(1)  # unpadded: the same tokens; padded again from here on
    assert eng.runner.fused_layers[1].qkv.weight.shape[0] == sum(eng.runner.fused_layers[1].qkv.sizes)
    assert [c.tokens for c in eng.generate(prompts, greedy)] == hf
    eng.runner.set_qkv_pad(64)
    params = SamplingParams(temperature=0.8, max_new_tokens=16, seed=2)
    for c in eng.generate(prompts, params):
        torch.testing.assert_close(torch.tensor(c.logprobs), _teacher_forced(model, c, params), atol=1e-4, rtol=0)
    with torch.no_grad():  # in place (an optimizer step): the fused GEMM reads it
        model.model.layers[1].mlp.up_proj.weight.mul_(-2.0)
        attn.v_proj.weight.add_(0.05)
    for pr, c in zip(prompts, eng.generate(prompts, greedy)):
        assert c.tokens == _hf_greedy(model, pr, 16)
    attn.q_proj.weight.data = attn.q_proj.weight.data.clone() * 1.5  # new storage: found and re-fused
    assert not eng.runner.fused_layers[1].valid()
    for pr, c in zip(prompts, eng.generate(prompts, greedy)):
        assert c.tokens == _hf_greedy(model, pr, 16)
    assert eng.runner.fused_layers[1].valid()
    model.save_pretrained(tmp_path / "saved")
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(back.model.layers[1].self_attn.q_proj.weight, attn.q_proj.weight)


def test_fp8_index_keys_through_convert_and_the_engine(tmp_path, monkeypatch):
    """`convert --index-dtype fp8` writes the field; the engine's decode cache then stores e4m3 keys and
    their scales; the Triton path (interpreter) gives the reference path's tokens (log-probs within 0.02),
    and both stay near a teacher-forced forward over unquantized keys; a bad value is a usage error."""
    from typer.testing import CliRunner

    from sparse_rl.cli.main import app

    init_model(tmp_path / "dense", ModelInitConfig(arch="llama", size="tiny", seed=1))
    args = ["convert", str(tmp_path / "dense"), str(tmp_path / "fp8"), "--index-topk", str(TOPK), "--index-heads", "2",
            "--index-dim", "16", "--sink", "1", "--window", "2", "--dense-layers", "0", "--seed", "3"]
    res = CliRunner().invoke(app, args + ["--index-dtype", "fp8"])
    assert res.exit_code == 0, res.output
    assert SparseConfig.load(tmp_path / "fp8").index_dtype == "fp8"
    bad = CliRunner().invoke(app, args[:3] + ["--index-dtype", "int4"])
    assert bad.exit_code == 2 and "--index-dtype int4" in bad.output
    with pytest.raises(Exception, match="token-level"):
        SparseConfig(index_dtype="fp8", key_block=4)
    model = load_model(tmp_path / "fp8", attention="sparse")
    prompts = _prompts(5, (14, 9))
    params = SamplingParams(temperature=0.7, max_new_tokens=6, seed=5)
    eng = _engine(model, max_batch=2)
    ref = eng.generate(prompts, params)
    assert eng.cache.idx.dtype == torch.float8_e4m3fn and eng.cache.idx_scale.dtype == torch.float32
    monkeypatch.setenv("SPARSE_RL_BACKEND", "triton")
    tri = _engine(model, max_batch=2).generate(prompts, params)
    monkeypatch.setenv("SPARSE_RL_BACKEND", "torch")
    for a, b in zip(ref, tri):  # the kernel quantizes its fp32 key, the reference the module's: an fp8 value
        # may round the other way, and a near-tie in the selection with it (log-probs 1e-3 apart, not 1e-5)
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=0.02, rtol=0)
    for c in ref:  # the HF forward scores unquantized keys: close, not equal
        torch.testing.assert_close(torch.tensor(c.logprobs), _teacher_forced(model, c, params), atol=0.05, rtol=0)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_chunked_prefill_keeps_outputs_and_interleaves_decode(llama_dir, mode):
    """prefill_chunk: no prefill call takes more than the chunk's tokens, a long prompt's chunks alternate
    with decode steps of the running sequences, and the tokens and log-probs are those of whole-prompt
    prefill (greedy and seeded sampling, n samples sharing a prompt, more prompts than slots; sparse mode
    with prompts past the top-k, so chunks attend through the selection over the earlier chunks' keys)."""
    model = load_model(llama_dir, attention=mode)
    prompts = _prompts(11, (23, 4, 17, 30, 6))
    for params in (SamplingParams(temperature=0, max_new_tokens=12),
                   SamplingParams(samples=2, temperature=0.9, max_new_tokens=12, seed=4)):
        whole = _engine(model, max_batch=4).generate(prompts, params)
        eng = _engine(model, max_batch=4, prefill_chunk=7)
        calls = []
        prefill, decode = eng.runner.prefill, eng.runner.decode

        def rec_prefill(cache, tokens, lengths, slots, m, start=0):
            calls.append(("prefill", tokens.numel(), start))
            return prefill(cache, tokens, lengths, slots, m, start=start)

        def rec_decode(*a, **k):
            calls.append(("decode", 0, 0))
            return decode(*a, **k)

        eng.runner.prefill, eng.runner.decode = rec_prefill, rec_decode
        chunked = eng.generate(prompts, params)
        assert max(n for kind, n, _ in calls if kind == "prefill") <= 7
        starts = [i for i, c in enumerate(calls) if c[0] == "prefill" and c[2] > 0]
        assert starts and any(calls[i - 1][0] == "decode" for i in starts)  # decoding went on between chunks
        for a, b in zip(whole, chunked):
            assert a.tokens == b.tokens
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
    with pytest.raises(UsageError, match="prefill_chunk"):
        _engine(model, prefill_chunk=0)


def test_skinny_gemm_names_are_checked():
    """`ModelRunner(skinny_gemm=)`: True is every decode GEMM, names must be among forward.SKINNY."""
    from sparse_rl.rl.rollout.forward import SKINNY, _skinny_set

    assert _skinny_set(True) == frozenset(SKINNY) and _skinny_set(None) == frozenset()
    assert _skinny_set(("o_proj", "down_proj")) == {"o_proj", "down_proj"}
    with pytest.raises(ValueError, match="lm_head"):
        _skinny_set(("lm_head",))


def test_blas_choice_is_checked_and_restored(llama_dir):
    """`ModelRunner(blas=)`: one of forward.BLAS; the step's library is set for the block only and restored
    (a runner argument, not a process-wide setting); on a CPU it is a no-op."""
    from sparse_rl.rl.rollout.forward import _blas_library, _check_blas

    assert _check_blas(None) is None and _check_blas("cublaslt") == "cublaslt"
    with pytest.raises(ValueError, match="blas"):
        _check_blas("mkl")
    before = torch.backends.cuda.preferred_blas_library()
    with _blas_library("cublaslt", cuda=False):
        assert torch.backends.cuda.preferred_blas_library() == before
    if torch.cuda.is_available():  # a CPU build cannot select cuBLASLt at all
        with _blas_library("cublaslt", cuda=True):
            assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
        assert torch.backends.cuda.preferred_blas_library() == before
    with pytest.raises(ValueError, match="blas"):
        _engine(load_model(llama_dir, attention="sparse"), runner_options={"blas": "mkl"})


def test_fused_indexer_launch_gives_the_logits_of_two_launches(llama_dir, monkeypatch, random_cache):
    """`ModelRunner(fuse_indexer=)`: a sparse layer's q/k norm + RoPE + cache write and its indexer's per-token
    work as one launch (`ops.qk_rope_indexer_decode`, the default) or two (`qk_norm_rope_cache`,
    `indexer_decode`): one eager sparse step on the Triton kernels (interpreter; rows at 20 and 14 keys, past the
    top-k of 12, on a random cache) gives bitwise the same logits and the same caches either way."""
    from sparse_rl.rl.rollout import forward

    model = load_model(llama_dir, attention="sparse")
    eng = _engine(model, max_batch=2, fuse_projections=True)
    assert eng.runner.fuse_indexer
    fused = []
    real = forward.qk_rope_indexer_decode
    monkeypatch.setattr(forward, "qk_rope_indexer_decode", lambda *a, **k: fused.append(1) or real(*a, **k))
    monkeypatch.setenv("SPARSE_RL_BACKEND", "triton")
    cache = random_cache(eng, 32, 6)
    start = [t.clone() for t in (cache.k, cache.v, cache.idx)]
    tok, pos = torch.tensor([7, 99]), torch.tensor([19, 13])
    out = {}
    with torch.inference_mode():
        for on in (True, False):
            for t, t0 in zip((cache.k, cache.v, cache.idx), start):
                t.copy_(t0)
            eng.runner.fuse_indexer = on
            n = len(fused)
            out[on] = (eng.runner.decode_eager(cache, tok, pos, 20, "sparse"), cache.k.clone(), cache.v.clone(),
                       cache.idx.clone())
            assert (len(fused) > n) == on
    monkeypatch.setenv("SPARSE_RL_BACKEND", "torch")
    assert all(torch.equal(a, b) for a, b in zip(out[True], out[False]))


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_select_streams_give_the_logits_of_one_stream(llama_dir, monkeypatch, backend, random_cache):
    """`ModelRunner(select_streams=n)`: the sparse layers' select + attention in n row groups (one CUDA stream each
    on a GPU; in turn here) give bitwise the logits of the whole batch at once: one eager sparse step of 3 rows at
    20, 14 and 26 keys (past the top-k of 12) on a random cache, groups of (1, 2) and (1, 1, 1), on the Triton
    kernels (interpreter; on the reference ops within float rounding); the grouped path runs once a sparse layer; the sync select's
    `sync_min_batch` is dropped for the groups; n < 1 is refused."""
    import dataclasses

    from sparse_rl.rl.rollout import forward
    from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT

    model = load_model(llama_dir, attention="sparse")
    eng = _engine(model, max_batch=3, fuse_projections=True,
                  runner_options={"decode_select": dataclasses.replace(ENGINE_SELECT, sync_min_batch=2)})
    r = eng.runner
    assert r.select_streams == 1
    with pytest.raises(SparseRLError, match="select_streams 0"):
        r.set_select_streams(0)
    groups, sels = [], []
    real, real_sel = r._grouped_select_attend, forward.select
    monkeypatch.setattr(r, "_grouped_select_attend", lambda *a, **k: groups.append(1) or real(*a, **k))
    monkeypatch.setattr(forward, "select", lambda *a, **k: sels.append(k["decode_select"].sync_min_batch) or
                        real_sel(*a, **k))
    monkeypatch.setenv("SPARSE_RL_BACKEND", backend)
    cache = random_cache(eng, 32, 8)
    tok, pos = torch.tensor([7, 99, 3]), torch.tensor([19, 13, 25])
    sparse_layers = sum(1 for i in range(r.n_layers) if r._sparse(i, "sparse"))
    out = {}
    with torch.inference_mode():
        for n in (1, 2, 3):
            r.set_select_streams(n)
            del groups[:], sels[:]
            out[n] = r.decode_eager(cache, tok, pos, 32, "sparse")
            assert len(groups) == (0 if n == 1 else sparse_layers)
            assert sels == ([2] * sparse_layers if n == 1 else [0] * (n * sparse_layers))
    monkeypatch.setenv("SPARSE_RL_BACKEND", "torch")
    for n in (2, 3):  # the kernels read each row alone: bitwise; the reference's batched matmuls may round apart
        if backend == "triton":
            assert torch.equal(out[1], out[n])
        else:
            torch.testing.assert_close(out[n], out[1], atol=1e-6, rtol=0)


@pytest.mark.interpreter
def test_pdl_resolves_off_on_the_cpu_and_is_threaded_to_every_step_kernel(llama_dir, monkeypatch, pdl_kernel_name,
                                                                           random_cache):
    """`ModelRunner(pdl=True)` on a CPU is no error and resolves off (`_backend.resolve_pdl`); with the choice
    forced on (as on an H200), one eager sparse decode step on the Triton kernels (interpreter; 2 rows at 20
    and 14 keys, past the top-k of 12, on a random cache) waits in `gdc_wait` in every kernel it launches
    (fused norms / RoPE / SiLU, the indexer's per-token kernel, the score pass, the fine select's passes, the
    decode attention) and gives bitwise the logits of plain launches; at level 2 each also triggers its
    dependents (`gdc_launch_dependents`) after the wait."""
    import triton.language as tl

    from sparse_rl.rl.rollout import forward

    from sparse_rl.sparse.ops.indexer_topk.decode_select import DecodeSelect

    model = load_model(llama_dir, attention="sparse")
    # the fine select (the engine's default until session 27): its three Triton passes take the runner's PDL too
    eng = _engine(model, max_batch=2, fuse_projections=True,
                  runner_options={"pdl": True, "decode_select": DecodeSelect("fine", score_block=64)})
    assert eng.runner.pdl == 0
    eng.runner.set_pdl(None)
    assert eng.runner.pdl == 0  # nothing resolves on on a CPU, whatever PDL_DEFAULT says
    with pytest.raises(ValueError, match="pdl"):
        eng.runner.set_pdl(3)
    waits = []
    monkeypatch.setattr(tl.extra.cuda, "gdc_wait", lambda: waits.append(pdl_kernel_name()))
    launches = []
    monkeypatch.setattr(tl.extra.cuda, "gdc_launch_dependents", lambda: launches.append(pdl_kernel_name()))
    monkeypatch.setattr(forward, "resolve_pdl", lambda pdl, device, default: int(default if pdl is None else pdl))
    monkeypatch.setenv("SPARSE_RL_BACKEND", "triton")
    cache = random_cache(eng, 32, 4)
    tok, pos = torch.tensor([7, 99]), torch.tensor([19, 13])
    with torch.inference_mode():
        plain = eng.runner.decode_eager(cache, tok, pos, 20, "sparse")
        assert waits == []
        eng.runner.set_pdl(True)
        assert eng.runner.pdl == 1
        early = eng.runner.decode_eager(cache, tok, pos, 20, "sparse")
        n_wait = len(waits)
        eng.runner.set_pdl(2)
        trig = eng.runner.decode_eager(cache, tok, pos, 20, "sparse")
    monkeypatch.setenv("SPARSE_RL_BACKEND", "torch")
    # a sparse layer's q/k RoPE and its indexer run as one launch (`_qk_rope_index_kernel`, the runner's default)
    assert {"_add_rmsnorm_kernel", "_qk_rope_index_kernel", "_silu_mul_kernel", "_score_max",
            "_hist_chunk", "_sub_gather", "_resolve_write", "_fwd_kernel"} <= set(waits)
    assert launches == waits[n_wait:]  # level 2: every program triggers its dependents right after its wait
    assert torch.equal(plain, early) and torch.equal(plain, trig)
    # the default level (None) is the eager step's alone; the compiled step's inductor PDL only when asked for
    assert eng.runner._inductor_pdl()
    eng.runner.set_pdl(None)
    assert eng.runner.pdl == forward.PDL_DEFAULT and not eng.runner._inductor_pdl()
