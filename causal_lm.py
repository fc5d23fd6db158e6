"""A Hugging Face transformers causal LM trained through linear_cross_entropy, its (tokens, vocabulary)
logits never built: fuse_causal_lm_loss(model) replaces the model instance's forward.

A call with labels runs the model's own forward with two stand-ins, for that call only:
- the output layer (model.get_output_embeddings(), an nn.Linear: lm_head) records its input, the final
  hidden states, and returns an empty (..., 0) tensor where the logits were; what the forward does to
  them after (Gemma 2's softcap) costs nothing;
- model.loss_function (transformers' ForCausalLMLoss) becomes causal_lm_loss on the recorded hidden
  states and the layer's weight and bias, with the keywords the forward passes on
  (num_items_in_batch, ignore_index, shift_labels).
Everything else runs as the model wrote it: its decoder and outputs (past_key_values, hidden_states,
attentions), what it adds to the loss (a mixture of experts' aux loss), its slicing for
logits_to_keep (num_logits_to_keep before), and the hooks around it: the loss is computed inside
the model's forward, where FSDP2's fully_shard(model) has the head's weight gathered.
Without labels the model's forward runs untouched: generation and logits as before.

transformers is not imported here: the model brings it.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types

import torch
import torch.nn.functional as F
from torch import nn

if __package__:
    from . import linear_cross_entropy as lce
else:
    import linear_cross_entropy as lce

# Config attributes (the model's or its text config's) whose logits are the softcap's s * tanh(z / s).
SOFTCAP_ATTRIBUTES = ("final_logit_softcapping", "logits_soft_cap")
# Config attributes of models that change their logits after the output layer in ways not passed on
# here (Granite divides by logits_scaling, Cohere multiplies by logit_scale, ...), with each one's
# value that changes nothing: any other value is refused.
OTHER_LOGIT_CHANGES = {"logits_scaling": 1.0, "logit_scale": 1.0, "output_multiplier": 1.0,
                       "unpadded_vocab_size": None}
# Keywords transformers' ForCausalLMLoss reads (shift_labels since 4.50 or so): honoured here where the model's
# loss function names them. It ignores every other one (the forward passes all its keywords on), and so does
# this, unless the model's loss function names it: then it raises.
LOSS_KEYWORDS = ("num_items_in_batch", "ignore_index", "shift_labels")


def fuse_causal_lm_loss(model):
    """Makes a transformers causal LM (LlamaForCausalLM, Qwen2/3, Mistral, Gemma 2, GPT-2, ...)
    compute its training loss with linear_cross_entropy, from the output layer's input and weight,
    without the (tokens, vocabulary) logits. Returns the model (the same object).

        model = losses.fuse_causal_lm_loss(AutoModelForCausalLM.from_pretrained(...))
        out = model(input_ids, labels=input_ids)   # out.loss as the model's own; out.logits is None

    Replaces this instance's forward (not its class's; `del model.forward` undoes it). A call with
    labels gives the model's loss: transformers' ForCausalLMLoss, labels shifted (position t
    predicts label t + 1; shift_labels= as given, where the model's loss takes it), ignore_index
    (-100 unless passed), and with num_items_in_batch (gradient accumulation) the sum over it:
    reduction 'sum' with divisor=num_items_in_batch, folded into the gradient the forward writes.
    The output layer's bias, config.final_logit_softcapping (softcap=) and what the model adds to
    the loss (a MoE's aux loss) are kept; the loss is float32, as the model's (on CPU a 2-byte
    model's is rounded to its dtype first). Every output is
    returned as the model's (past_key_values, hidden_states, attentions; a tuple for
    return_dict=False) except logits, None. With logits_to_keep (num_logits_to_keep), the loss
    covers the kept positions, with shift_labels of their shape. Without labels the model's forward
    runs unchanged.

    The loss is computed inside the model's forward: under FSDP2 shard the output layer with the
    model (fully_shard(model)), not on its own. Raises TypeError for a model without an nn.Linear
    output layer (model.get_output_embeddings()) or whose forward takes no labels; ValueError for
    one whose loss is not ForCausalLMLoss or whose logits change after the output layer otherwise
    than by a softcap (config.logits_scaling, logit_scale, output_multiplier,
    unpadded_vocab_size); RuntimeError where the forward does not compute the loss through
    model.loss_function from one call of the output layer.
    """
    _output_layer(model)
    forward = _class_forward(model)
    if "labels" not in inspect.signature(forward).parameters:
        raise TypeError(f"fuse_causal_lm_loss expected a causal LM whose forward takes labels=, got "
                        f"{type(model).__name__}")
    _check_loss_function(model)
    _softcap(getattr(model, "config", None))
    if getattr(model, "_fused_causal_lm_loss", False):
        return model  # already fused
    # An instance's own forward (another library's wrapper) is kept and called; else the class's.
    model._forward_before_fused_loss = model.__dict__.get("forward")

    def fused_forward(self, *args, **kwargs):
        return _fused_call(self, args, kwargs)

    functools.update_wrapper(fused_forward, forward)  # its signature: trainers read the parameters
    model.forward = types.MethodType(fused_forward, model)
    model._fused_causal_lm_loss = True
    return model


def causal_lm_loss(hidden, output_layer: nn.Linear, labels, *, softcap=None, num_items_in_batch=None,
                   ignore_index: int = -100, shift_labels=None) -> torch.Tensor:
    """transformers' ForCausalLMLoss of output_layer(hidden) (softcapped), through linear_cross_entropy:
    hidden (..., T, H); labels (..., T) shifted (position t predicts labels[t + 1], the last
    ignored), or shift_labels (..., T) as given; the mean over labels not ignored, or with
    num_items_in_batch the sum divided by it. float32."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if tuple(shift_labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"the labels, shifted, have shape {tuple(shift_labels.shape)} but the output layer's input "
                         f"{tuple(hidden.shape)}: one label a position whose logits are kept (with logits_to_keep, "
                         f"pass shift_labels of the kept positions' shape)")
    divisor = num_items_in_batch
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.to(hidden.device).reshape(())
    # transformers takes the loss of the logits in float32: a 2-byte model's on CUDA is autocast's, whose
    # loss linear_cross_entropy keeps in float32 (not rounded to the logits' dtype). On CPU it is rounded.
    two_bytes = hidden.is_cuda and hidden.dtype in (torch.float16, torch.bfloat16) and not torch.is_autocast_enabled()
    with torch.autocast("cuda", dtype=hidden.dtype) if two_bytes else contextlib.nullcontext():
        loss = lce.linear_cross_entropy(hidden, output_layer.weight, shift_labels, linear_bias=output_layer.bias,
                                        reduction="mean" if divisor is None else "sum", ignore_index=ignore_index,
                                        softcap=softcap, divisor=divisor)
    return loss.float()


# ----------------------------------------------------------------------------------
# The checks: what the model must be for its loss to be this one.

def _class_forward(model):
    return type(model).forward


def _output_layer(model) -> nn.Linear:
    get = getattr(model, "get_output_embeddings", None)
    layer = get() if callable(get) else None
    if layer is None:
        raise TypeError(f"fuse_causal_lm_loss expected a transformers causal LM with an output layer "
                        f"(model.get_output_embeddings(), e.g. lm_head), got {type(model).__name__} without one")
    if not isinstance(layer, nn.Linear) or type(layer).forward is not nn.Linear.forward:
        raise TypeError(f"fuse_causal_lm_loss expected the output layer (model.get_output_embeddings()) to be an "
                        f"nn.Linear, logits = hidden @ weight.T (+ bias), got {type(layer).__name__}")
    if isinstance(layer, _fsdp2_module()):
        raise ValueError("fuse_causal_lm_loss computes the loss after the output layer's call, where FSDP2 has "
                         "resharded a layer sharded on its own: shard it with the model (fully_shard(model)), not "
                         "with fully_shard(model.lm_head)")
    return layer


def _fsdp2_module() -> tuple:
    """FSDP2's class of fully_shard modules, in a tuple for isinstance; empty before torch 2.6."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return ()
    return (FSDPModule,)


def _check_loss_function(model) -> None:
    function = getattr(model, "loss_function", None)
    if function is None:
        raise TypeError(f"fuse_causal_lm_loss expected a transformers (4.48+) causal LM, whose forward computes "
                        f"its loss by model.loss_function; {type(model).__name__} has none")
    name = getattr(function, "__name__", type(function).__name__)
    if name != "ForCausalLMLoss":
        raise ValueError(f"fuse_causal_lm_loss replaces transformers' ForCausalLMLoss (a causal LM's loss); "
                         f"{type(model).__name__}'s model.loss_function is {name}")
    attribute = getattr(type(model), "loss_function", None)
    if not isinstance(attribute, property) or attribute.fset is None:
        raise TypeError(f"fuse_causal_lm_loss replaces model.loss_function for a call, which {type(model).__name__} "
                        f"does not let it do (transformers 4.48+ does)")


def _softcap(config):
    """The softcap of config (or its text config), None if none; ValueError for other changes of
    the logits after the output layer."""
    configs = [] if config is None else [config]
    if callable(getattr(config, "get_text_config", None)):
        configs.append(config.get_text_config())
    softcap = None
    for each in configs:
        for name, neutral in OTHER_LOGIT_CHANGES.items():
            value = getattr(each, name, None)
            if value is not None and value != neutral:
                raise ValueError(f"fuse_causal_lm_loss cannot fuse a model whose logits change after the output "
                                 f"layer: config.{name} = {value} (only a softcap, "
                                 f"config.final_logit_softcapping, is passed on)")
        for name in SOFTCAP_ATTRIBUTES:
            softcap = getattr(each, name, None) if softcap is None else softcap
    return softcap


# ----------------------------------------------------------------------------------
# The call.

def _fused_call(model, args, kwargs):
    inner = model.__dict__.get("_forward_before_fused_loss") or _class_forward(model).__get__(model)
    signature = inspect.signature(inner)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return inner(*args, **kwargs)  # the model's own error
    if bound.arguments.get("labels") is None:
        return inner(*args, **kwargs)
    wants_dict = _ask_for_a_dict(bound, signature, model.config)
    layer = _output_layer(model)  # again: resize_token_embeddings may have replaced it
    _check_loss_function(model)
    with _stand_ins(model, layer, _softcap(getattr(model, "config", None))) as calls:
        try:
            output = inner(*bound.args, **bound.kwargs)
        except Exception as error:
            if calls["layer"] and not calls["loss"]:  # empty logits met a loss of the model's own
                raise RuntimeError(f"{type(model).__name__}'s forward failed after its output layer without calling "
                                   f"model.loss_function: fuse_causal_lm_loss needs a forward that computes its "
                                   f"loss there (transformers' ForCausalLMLoss)") from error
            raise
    if not calls["loss"]:
        raise RuntimeError(f"{type(model).__name__}'s forward took labels but did not call model.loss_function: "
                           f"fuse_causal_lm_loss cannot fuse its loss")
    if isinstance(output, tuple):
        raise TypeError(f"{type(model).__name__}'s forward returned a tuple for return_dict=True")
    # A ModelOutput keeps a field set to None in its dict: built anew without the empty logits.
    output = type(output)(**{key: value for key, value in output.items() if key != "logits"})
    return output if wants_dict else output.to_tuple()


def _ask_for_a_dict(bound, signature, config) -> bool:
    """Sets return_dict=True in the bound call (where the forward takes it) and returns what the
    caller asked for: its return_dict, else the config's."""
    parameters = signature.parameters
    keywords = next((name for name, p in parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if "return_dict" in parameters:
        asked = bound.arguments.get("return_dict")
        bound.arguments["return_dict"] = True
    elif keywords is not None:
        extra = bound.arguments.setdefault(keywords, {})
        asked = extra.get("return_dict")
        extra["return_dict"] = True
    else:
        asked = None
    if asked is None:
        asked = getattr(config, "return_dict", True)
    return bool(asked)


@contextlib.contextmanager
def _stand_ins(model, layer, softcap):
    """For one forward: the output layer records its input and returns empty logits; the loss
    function is causal_lm_loss on that input. Yields the counts of their calls."""
    calls = {"layer": 0, "loss": 0}
    hidden_states = []

    def record_hidden(hidden):
        calls["layer"] += 1
        hidden_states.append(hidden)
        return hidden.new_empty((*hidden.shape[:-1], 0))

    loss_parameters = [name for name, p in inspect.signature(model.loss_function).parameters.items()
                       if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]

    def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                      shift_labels=None, **kwargs):
        calls["loss"] += 1
        refused = [name for name in kwargs if name in loss_parameters and kwargs[name] is not None]
        if "shift_labels" not in loss_parameters:  # an older ForCausalLMLoss ignores it: so does this
            shift_labels = None
        if refused:
            raise ValueError(f"fuse_causal_lm_loss honours the loss keywords {', '.join(LOSS_KEYWORDS)}; the model's "
                             f"loss function also takes {', '.join(refused)}, which it does not")
        if len(hidden_states) != 1:
            raise RuntimeError(f"fuse_causal_lm_loss expected one call of the output layer before the loss, got "
                               f"{len(hidden_states)}")
        return causal_lm_loss(hidden_states[0], layer, labels, softcap=softcap,
                              num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                              shift_labels=shift_labels)

    saved = {name: obj.__dict__[name] for obj, name in ((layer, "forward"), (model, "_loss_function"))
             if name in obj.__dict__}
    layer.forward = record_hidden
    model._loss_function = loss_function  # what transformers' loss_function property returns
    try:
        if model.loss_function is not loss_function:
            raise TypeError(f"fuse_causal_lm_loss could not replace {type(model).__name__}'s model.loss_function "
                            f"(transformers 4.48+ reads model._loss_function)")
        yield calls
    finally:
        for obj, name in ((layer, "forward"), (model, "_loss_function")):
            if name in saved:
                setattr(obj, name, saved[name])
            else:
                delattr(obj, name)
