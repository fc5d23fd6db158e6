"""fuse_causal_lm_loss (issue 47): tiny random transformers causal LMs (2 layers, hidden 32,
vocabulary 97) of each family the issue names, fused and not, from the same weights: the same loss
and gradients (float64 models; the model's own loss is float32, as its logits.float() makes it),
with -100 labels, with num_items_in_batch (tensor and int), shift_labels, logits_to_keep and a
MoE's aux loss; the same outputs but logits (None), the output layer never run (no logits built);
without labels the model's own forward; AdamW steps to the same weights (float32), on one process
and under FSDP2 on 2 CPU ranks (gloo); clear errors for what it cannot fuse. Skipped without
transformers 4.48+ (model.loss_function, replaceable)."""
import copy
import inspect
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

transformers = pytest.importorskip("transformers", minversion="4.48")

import losses  # noqa: E402
from helpers import fsdp2_mesh, run_on_ranks  # noqa: E402

VOCAB, HIDDEN, BATCH, SEQUENCE = 97, 32, 2, 9
DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
# name: (config class, model class, config beyond DECODER's). A class this transformers lacks skips.
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    # Logits of a tiny random model are about 0.1: a softcap of 0.1 bends them.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "final_logit_softcapping": 0.1}),
    # GPT-2's names, its dropout off (the models train in train mode: the same draws are not promised);
    # its output layer is tied to the token embedding.
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": HIDDEN, "n_layer": 2, "n_head": 4, "n_positions": 64,
                                              "vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0,
                                              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                                              "attn_implementation": "eager"}),
}
# The model's loss is computed in float32 from its float64 logits, ours in float64: their difference.
RTOL_FLOAT64_MODEL = 1e-6
RTOL_TRAINING = 1e-5  # float32 models' weights after AdamW steps (over 15 seeds, at most 1.4e-6)
PARAMETER_RTOL_TRAINING = 1e-4  # each weight tensor alone (see test_adamw_steps_reach_the_models_weights)


def make_model(name, dtype=torch.float64, **config_changes):
    config_name, model_name, extra = MODELS[name]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    settings = {**(extra if name == "gpt2" else {**DECODER, **extra}), **config_changes}
    config = getattr(transformers, config_name)(**settings)
    return getattr(transformers, model_name)(config).to(dtype)


def fused_and_not(name, dtype=torch.float64, **config_changes):
    """(fused model, the model unfused): the same weights."""
    model = make_model(name, dtype, **config_changes)
    return losses.fuse_causal_lm_loss(copy.deepcopy(model)), model


def keep_keyword(model):
    """logits_to_keep, num_logits_to_keep before transformers 4.50 or so; None where the forward
    takes neither (GPT-2 before then)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in parameters), None)


def takes_shift_labels(model) -> bool:
    return "shift_labels" in inspect.signature(model.loss_function).parameters


def batch():
    """Token ids and their labels, some ignored: a padded start, and scattered ones."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE))
    labels = ids.clone()
    labels[0, :3] = -100
    labels[torch.rand(labels.shape) < 0.2] = -100
    return ids, labels


def rel_err(value, truth):
    return ((value.double() - truth.double()).norm() / truth.double().norm()).item()


def assert_gradients_match(fused, model, rtol):
    for (name, ours), theirs in zip(fused.named_parameters(), model.parameters()):
        assert (ours.grad is None) == (theirs.grad is None), name
        if theirs.grad is not None:
            assert rel_err(ours.grad, theirs.grad) <= rtol, f"{name}: {rel_err(ours.grad, theirs.grad):.2e}"


def assert_same_outputs(ours, theirs, where="output"):
    """Tensors equal, tuples and lists element by element, caches layer by layer."""
    if isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs), where
    elif isinstance(theirs, (tuple, list)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_outputs(a, b, f"{where}[{i}]")
    else:
        assert type(ours) is type(theirs), where
        for i, (a, b) in enumerate(zip(getattr(ours, "layers", ()), getattr(theirs, "layers", ()))):
            assert_same_outputs([a.keys, a.values], [b.keys, b.values], f"{where}.layers[{i}]")


@pytest.fixture
def output_layer_calls(monkeypatch):
    """The nn.Linear modules whose forward ran (the output layer's builds the logits)."""
    calls = []
    linear_forward = nn.Linear.forward

    def recording_forward(self, input):
        calls.append(self)
        return linear_forward(self, input)

    monkeypatch.setattr(nn.Linear, "forward", recording_forward)
    return calls


@pytest.mark.parametrize("num_items", [None, "tensor", "int"])
@pytest.mark.parametrize("name", list(MODELS))
def test_loss_gradients_and_outputs_are_the_models(name, num_items, output_layer_calls):
    fused, model = fused_and_not(name)
    ids, labels = batch()
    kwargs = {} if num_items is None else {"num_items_in_batch": 11 if num_items == "int" else torch.tensor(11)}
    extra = {"output_hidden_states": True, "output_attentions": True}
    theirs = model(ids, labels=labels, **extra, **kwargs)
    assert model.get_output_embeddings() in output_layer_calls  # seen where it runs
    output_layer_calls.clear()
    ours = fused(ids, labels=labels, **extra, **kwargs)
    assert fused.get_output_embeddings() not in output_layer_calls  # no logits built
    assert ours.logits is None and "logits" not in ours.keys()
    assert ours.loss.dtype == theirs.loss.dtype == torch.float32
    assert rel_err(ours.loss, theirs.loss) <= RTOL_FLOAT64_MODEL
    assert set(ours.keys()) == set(theirs.keys()) - {"logits"}
    for key in ours.keys():
        if key != "loss":
            assert_same_outputs(ours[key], theirs[key], key)
    ours.loss.backward()
    theirs.loss.backward()
    assert_gradients_match(fused, model, RTOL_FLOAT64_MODEL)


@pytest.mark.parametrize("name", list(MODELS))
def test_without_labels_the_models_forward_runs(name):
    fused, model = fused_and_not(name)
    ids, _ = batch()
    ours, theirs = fused(ids), model(ids)
    assert type(ours) is type(theirs)
    assert torch.equal(ours.logits, theirs.logits)
    if keep_keyword(model):
        keep = {keep_keyword(model): 1}
        ours, theirs = fused(ids, **keep), model(ids, **keep)
        assert ours.logits.shape[1] == 1 and torch.equal(ours.logits, theirs.logits)
    greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(fused.generate(ids, **greedy), model.generate(ids, **greedy))
    # Trainers read the forward's parameters (dataset columns, whether it takes num_items_in_batch).
    assert inspect.signature(fused.forward) == inspect.signature(model.forward)


@pytest.mark.parametrize("name", list(MODELS))
def test_adamw_steps_reach_the_models_weights(name):
    """float32: two steps, the second with gradient accumulation's num_items_in_batch; the weights,
    all of them as one vector, within RTOL_TRAINING. A step moves each weight by about lr, whatever
    its gradient's size: parameters that start at zero (biases, Gemma's norms) move by their
    gradients' rounding where those are tiny (a key's bias has none but rounding: the softmax
    ignores the shift it adds), so each one alone is held to PARAMETER_RTOL_TRAINING only where it
    does not start at zero (over 15 seeds, at most 8e-6). lr 1e-3 is 5% of the weights' scale
    (0.02); at 1e-2 the second step's gradients, of weights moved 50%, amplify float32's rounding."""
    fused, model = fused_and_not(name, torch.float32)
    starts_at_zero = {name_: not weight.any() for name_, weight in model.named_parameters()}
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (fused, model)]
    for step in range(2):
        ids, labels = batch()
        kwargs = {"num_items_in_batch": torch.tensor(13)} if step else {}
        for m, optimizer in zip((fused, model), optimizers):
            m(ids, labels=labels, **kwargs).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    weights = [torch.cat([weight.detach().flatten() for weight in m.parameters()]) for m in (fused, model)]
    assert rel_err(*weights) <= RTOL_TRAINING
    for (name_, ours), theirs in zip(fused.named_parameters(), model.parameters()):
        if not starts_at_zero[name_]:
            assert rel_err(ours, theirs) <= PARAMETER_RTOL_TRAINING, name_


def test_shift_labels_are_taken_as_the_models_loss_takes_them():
    """As given, or ignored where the model's loss ignores them (older transformers)."""
    fused, model = fused_and_not("llama")
    ids, labels = batch()
    shift_labels = labels.roll(-2, dims=1)  # predict two ahead: no shift of ours may happen
    ours, theirs = fused(ids, labels=labels, shift_labels=shift_labels), model(ids, labels=labels,
                                                                             shift_labels=shift_labels)
    assert rel_err(ours.loss, theirs.loss) <= RTOL_FLOAT64_MODEL


def test_evaluation_without_grad():
    fused, model = fused_and_not("llama")
    ids, labels = batch()
    with torch.no_grad():
        ours, theirs = fused(ids, labels=labels), model(ids, labels=labels)
    assert ours.logits is None and rel_err(ours.loss, theirs.loss) <= RTOL_FLOAT64_MODEL


def test_ignore_index_is_honoured():
    fused, model = fused_and_not("llama")
    ids, labels = batch()
    labels[labels == -100] = 5  # then ignored as 5
    ours, theirs = fused(ids, labels=labels, ignore_index=5), model(ids, labels=labels, ignore_index=5)
    assert rel_err(ours.loss, theirs.loss) <= RTOL_FLOAT64_MODEL


def test_logits_to_keep_with_labels():
    """The loss covers the kept positions; their labels must be shift_labels of their shape."""
    fused, model = fused_and_not("llama")
    ids, labels = batch()
    keep = {keep_keyword(model): 4}
    if takes_shift_labels(model):
        kept = labels[:, -4:].contiguous()  # the model's loss views it
        ours = fused(ids, labels=labels, shift_labels=kept, **keep)
        theirs = model(ids, labels=labels, shift_labels=kept, **keep)
        assert rel_err(ours.loss, theirs.loss) <= RTOL_FLOAT64_MODEL
    with pytest.raises(ValueError, match="logits_to_keep"):
        fused(ids, labels=labels, **keep)


def test_return_dict_false_gives_the_tuple_without_logits():
    fused, model = fused_and_not("llama")
    ids, labels = batch()
    ours, theirs = fused(ids, labels=labels, return_dict=False), model(ids, labels=labels, return_dict=False)
    assert isinstance(ours, tuple) and len(ours) == len(theirs) - 1  # loss, cache: the logits left out
    assert rel_err(ours[0], theirs[0]) <= RTOL_FLOAT64_MODEL
    assert_same_outputs(ours[1:], theirs[2:])


def test_a_call_without_return_dict_follows_the_configs():
    """The helper that decides what a call gets back, alone (current transformers models fail in their own
    forward with config.return_dict=False, fused or not): the call's return_dict, else the config's, else a
    dict; the forward is asked for a dict either way. Fails if fuse_causal_lm_loss ignores config.return_dict."""
    import causal_lm

    def named(input_ids, labels=None, return_dict=None):  # each forward returns the return_dict it got
        return return_dict

    def keywords(input_ids, labels=None, **kwargs):
        return kwargs.get("return_dict")

    def neither(input_ids, labels=None):
        return True  # nothing to ask for
    for config in (types.SimpleNamespace(return_dict=False), types.SimpleNamespace(return_dict=True),
                   types.SimpleNamespace()):
        from_config = getattr(config, "return_dict", True)
        for forward in (named, keywords, neither):
            signature = inspect.signature(forward)
            for asked in ((None, True, False) if forward is not neither else (None,)):
                bound = signature.bind(1, labels=2, **({} if asked is None else {"return_dict": asked}))
                wants = causal_lm._ask_for_a_dict(bound, signature, config)
                assert wants is (from_config if asked is None else asked), (forward.__name__, config, asked)
                assert forward(*bound.args, **bound.kwargs) is True, (forward.__name__, config, asked)


def test_an_output_layer_with_bias():
    model = make_model("llama")
    model.lm_head = nn.Linear(HIDDEN, VOCAB, bias=True, dtype=torch.float64)
    fused = losses.fuse_causal_lm_loss(copy.deepcopy(model))
    ids, labels = batch()
    ours, theirs = fused(ids, labels=labels), model(ids, labels=labels)
    assert rel_err(ours.loss, theirs.loss) <= RTOL_FLOAT64_MODEL
    ours.loss.backward()
    theirs.loss.backward()
    assert_gradients_match(fused, model, RTOL_FLOAT64_MODEL)
    assert fused.lm_head.bias.grad is not None


def test_a_mixture_of_experts_keeps_its_aux_loss():
    """Mixtral adds router_aux_loss_coef times its load-balancing loss to the loss it computes."""
    if not hasattr(transformers, "MixtralForCausalLM"):
        pytest.skip("no MixtralForCausalLM")
    config = transformers.MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2,
                                        router_aux_loss_coef=0.5, experts_implementation="eager")  # float64
    model = transformers.MixtralForCausalLM(config).double()
    fused = losses.fuse_causal_lm_loss(copy.deepcopy(model))
    ids, labels = batch()
    ours = fused(ids, labels=labels, output_router_logits=True)
    theirs = model(ids, labels=labels, output_router_logits=True)
    assert theirs.aux_loss > 0 and torch.equal(ours.aux_loss, theirs.aux_loss)
    assert rel_err(ours.loss, theirs.loss) <= RTOL_FLOAT64_MODEL
    ours.loss.backward()
    theirs.loss.backward()
    assert_gradients_match(fused, model, RTOL_FLOAT64_MODEL)


def test_fusing_twice_copies_and_undoing():
    model = make_model("llama")
    fused = losses.fuse_causal_lm_loss(model)
    forward = fused.forward
    assert losses.fuse_causal_lm_loss(fused) is fused and fused.forward == forward
    ids, labels = batch()
    loss = fused(ids, labels=labels).loss
    copied = copy.deepcopy(fused)  # its forward runs the copy
    copied.lm_head.weight.data.zero_()
    uniform = copied(ids, labels=labels)
    assert uniform.logits is None and torch.allclose(uniform.loss, torch.tensor(VOCAB).log().float())
    assert torch.equal(fused(ids, labels=labels).loss, loss)
    del fused.forward
    assert fused(ids, labels=labels).logits is not None


def test_what_cannot_be_fused_raises():
    with pytest.raises(TypeError, match="output layer"):
        losses.fuse_causal_lm_loss(transformers.LlamaModel(transformers.LlamaConfig(**DECODER)))
    model = make_model("llama")
    model.lm_head = nn.Sequential(nn.Linear(HIDDEN, VOCAB))
    with pytest.raises(TypeError, match="nn.Linear"):
        losses.fuse_causal_lm_loss(model)
    with pytest.raises(TypeError, match="output layer"):
        losses.fuse_causal_lm_loss(nn.Linear(2, 3))  # not a causal LM
    if hasattr(transformers, "GraniteForCausalLM"):
        granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(**DECODER, logits_scaling=4.0))
        with pytest.raises(ValueError, match="logits_scaling"):
            losses.fuse_causal_lm_loss(granite)
    model = make_model("llama")
    model.loss_function = lambda logits, labels, **kwargs: logits.sum()
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        losses.fuse_causal_lm_loss(model)


def test_a_loss_keyword_not_honoured_is_refused():
    """A loss function that names a keyword beyond those honoured (as a later transformers might)."""
    fused = losses.fuse_causal_lm_loss(make_model("llama"))
    model_loss = fused.loss_function

    def ForCausalLMLoss(logits, labels, vocab_size, label_smoothing=0.0, **kwargs):  # noqa: N802
        return model_loss(logits, labels, vocab_size, **kwargs)

    fused.loss_function = ForCausalLMLoss
    ids, labels = batch()
    assert fused(ids, labels=labels).logits is None
    with pytest.raises(ValueError, match="label_smoothing"):
        fused(ids, labels=labels, label_smoothing=0.1)


def test_a_forward_with_a_loss_of_its_own_raises():
    """BartForCausalLM computes its cross-entropy inline (no model.loss_function): it cannot be fused."""
    if not hasattr(transformers, "BartForCausalLM"):
        pytest.skip("no BartForCausalLM")
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=HIDDEN, decoder_layers=1, encoder_layers=1,
                                     decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=64,
                                     encoder_ffn_dim=64, max_position_embeddings=64)
    fused = losses.fuse_causal_lm_loss(transformers.BartForCausalLM(config))
    ids, labels = batch()
    with pytest.raises(RuntimeError, match="loss_function"):
        fused(ids, labels=labels)
    assert fused(ids).logits.shape == (BATCH, SEQUENCE, VOCAB)


def train_under_fsdp2(rank, device):
    """On each of 2 ranks: Llama fused and not, each decoder layer and the root under fully_shard, two
    AdamW steps on this rank's batches: the same weights. The output layer sharded on its own raises."""
    from torch.distributed.fsdp import fully_shard
    weights, mesh = [], fsdp2_mesh(device)
    for fuse in (True, False):
        torch.manual_seed(0)  # the same initial weights on every rank, fused or not
        model = make_model("llama", torch.float32).to(device)
        if fuse:
            losses.fuse_causal_lm_loss(model)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root holds lm_head: gathered for the model's forward, where the loss is
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(1 + rank)
        for _ in range(2):
            ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=data).to(device)
            output = model(ids, labels=ids)
            assert output.logits is None or not fuse
            output.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        weights.append(torch.cat([weight.full_tensor().detach().flatten() for weight in model.parameters()]))
    assert rel_err(*weights) <= RTOL_TRAINING, rel_err(*weights)
    model = make_model("llama", torch.float32).to(device)
    fully_shard(model.lm_head, mesh=mesh)
    with pytest.raises(ValueError, match="fully_shard"):
        losses.fuse_causal_lm_loss(model)


def fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return dist.is_available()


@pytest.mark.skipif(not fsdp2_available(), reason="FSDP2 (fully_shard) needs torch 2.6+ and torch.distributed")
def test_fsdp2_training_on_cpu(tmp_path):
    run_on_ranks(train_under_fsdp2, (), "gloo", tmp_path / "store", 2, timeout=300)


@pytest.mark.gpu
def test_bfloat16_llama_on_cuda_against_float64():
    """The fused bfloat16 model's loss and gradients within twice the unfused bfloat16 model's error
    (or one bfloat16 rounding) of the float64 model's, norm-wise."""
    model = make_model("llama", torch.float64, vocab_size=1000).cuda()
    unfused = copy.deepcopy(model).to(torch.bfloat16)
    fused = losses.fuse_causal_lm_loss(copy.deepcopy(unfused))
    ids = torch.randint(0, 1000, (4, 64), device="cuda")
    labels = ids.clone()
    labels[:, :5] = -100
    outputs = [m(ids, labels=labels, num_items_in_batch=torch.tensor(200, device="cuda"))
               for m in (model, unfused, fused)]
    assert outputs[2].logits is None
    for output in outputs:
        output.loss.backward()
    floor = 2.0**-8
    assert rel_err(outputs[2].loss, outputs[0].loss) <= max(2 * rel_err(outputs[1].loss, outputs[0].loss), floor)
    # Both losses float32 of the same bf16 logits (not the fused one rounded to bf16, up to 2^-8 off).
    assert outputs[2].loss.dtype == torch.float32 and rel_err(outputs[2].loss, outputs[1].loss) <= 2.0**-11
    for (name, truth), eager, ours in zip(model.named_parameters(), unfused.parameters(), fused.parameters()):
        bound = max(2 * rel_err(eager.grad, truth.grad), floor)
        assert rel_err(ours.grad, truth.grad) <= bound, name
