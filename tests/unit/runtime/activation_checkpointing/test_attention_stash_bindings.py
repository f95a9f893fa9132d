# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Every backend entry's kernel calls, bound against PyTorch's own derivative formulas, on CPU.

The stash calls each backend's forward kernel, then, in the recompute's backward, the kernel's backward with the
arguments that PyTorch's derivative for the forward passes (torchgen/packaged/autograd/derivatives.yaml, shipped in
the torch wheel). A dispatch mode stands in for the kernels, CUDA ones included: it returns one distinct sentinel per
forward output, and the backward call's arguments are checked position by position, by identity, against the
formula's names. Swapped arguments of the same type (philox seed and offset, cum_seq_q and cum_seq_k, rng_state and
unused) or a fixed grad_input_mask fail here, which a check of shapes would let pass.
"""

import os
import re
import types

import pytest
import torch
import torchgen
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from deepspeed.runtime.activation_checkpointing import attention_stash

DERIVATIVES = os.path.join(os.path.dirname(torchgen.__file__), "packaged", "autograd", "derivatives.yaml")


def _derivative(op):
    """(argument names, output names, backward op, backward argument expressions) of ``op``'s derivative."""
    with open(DERIVATIVES) as file:
        entries = yaml.safe_load(file)
    entry = next(entry for entry in entries if entry["name"].startswith(f"{op}("))
    signature, _, returns = entry["name"].partition(" -> ")
    arguments = [
        part.split("=")[0].split()[-1] for part in signature[len(op) + 1:-1].split(", ") if part.strip() != "*"
    ]
    outputs = [part.split()[-1] for part in returns.strip("()").split(", ")]
    formulas = [value for key, value in entry.items() if key not in ("name", "output_differentiability", "dispatch")]
    assert len(formulas) == 1, formulas
    call = re.fullmatch(r"(\w+)\((.*)\)", formulas[0].strip())
    backward = call.group(1).removesuffix("_symint")
    return arguments, outputs, backward, [expression.strip() for expression in call.group(2).split(",")]


def _bind(func, args, kwargs):
    """The call's arguments by the schema's names, defaults filled in."""
    bound = {}
    positional = list(args)
    for argument in func._schema.arguments:
        if positional and not argument.kwarg_only:
            bound[argument.name] = positional.pop(0)
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        else:
            bound[argument.name] = argument.default_value
    assert not positional
    return bound


class _Kernels(TorchDispatchMode):
    """Stands in for the attention kernels: records each call and returns fresh, distinct objects."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.returned = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.__name__.startswith("_scaled_dot_product"):
            return func(*args, **(kwargs or {}))
        self.calls.append((func._schema.name.split("::")[-1], _bind(func, args, kwargs or {})))
        outputs = []
        for index, output in enumerate(func._schema.returns):
            if isinstance(output.type, torch.IntType):
                outputs.append(1000 + 10 * len(self.calls) + index)
            else:
                outputs.append(torch.full((1, ), float(index)))
        self.returned.append(outputs)
        return tuple(outputs)


def _same(actual, expected):
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        return actual is expected
    return actual == expected


BACKENDS = sorted({ops.name: ops for ops in attention_stash._BACKENDS.values()}.items())


@pytest.mark.parametrize("ops", [ops for _, ops in BACKENDS], ids=[name for name, _ in BACKENDS])
@pytest.mark.parametrize("needs_grad", [(True, True, True), (True, False, True), (False, True, False)],
                         ids=["qkv", "qv", "k"])
def test_backward_call_follows_pytorch_derivative(ops, needs_grad):
    forward_op, backward_op = ops.op, f"{ops.op}_backward"
    arguments, outputs, formula_op, expressions = _derivative(forward_op)
    assert formula_op == backward_op
    query, key, value, grad = (torch.randn(1, 2, 4, 8) for _ in range(4))
    takes_mask = any(name in arguments for name in ("attn_mask", "attn_bias"))
    mask = torch.randn(1, 1, 4, 4) if takes_mask else None
    kernels = _Kernels()
    with kernels:
        call_arguments = attention_stash._SdpaArguments(True, 0.25)
        out, tensors, scalars = ops.kernel(query, key, value, mask, call_arguments)
        # The stash node's context as its forward leaves it: the saved tensors, the ops, the scalars and the call's
        # arguments; its backward calls the ops' backward.
        context = types.SimpleNamespace(saved_tensors=(query, key, value, mask, out, *tensors),
                                        ops=ops,
                                        scalars=scalars,
                                        arguments=call_arguments,
                                        needs_input_grad=(*needs_grad, False, False))
        # Without grad, as autograd's engine runs a first-order backward (create_graph=False).
        with torch.no_grad():
            grads = attention_stash._AttentionNode.backward(context, grad)
    (forward_name, forward), (backward_name, backward) = kernels.calls
    assert (forward_name, backward_name) == (forward_op, backward_op)
    assert list(forward) == arguments

    # The forward call: the tensors given, no dropout, the log-sum-exp on, no debug mask.
    assert all(forward[name] is tensor for name, tensor in (("query", query), ("key", key), ("value", value)))
    assert (forward["dropout_p"], forward["is_causal"], forward["scale"]) == (0.0, True, 0.25)
    assert forward.get("compute_log_sumexp", True) is True and forward.get("return_debug_mask", False) is False
    mask_name = next((name for name in ("attn_mask", "attn_bias") if name in forward), None)
    assert mask_name is None or forward[mask_name] is mask
    assert out is kernels.returned[0][0]

    # The backward call, position by position, against the names in PyTorch's formula.
    values = {**forward, **dict(zip(outputs, kernels.returned[0])), "grad": grad}
    values["grad_input_mask"] = [*needs_grad, False]  # a mask that requires grad is refused before the kernels
    assert len(expressions) == len(backward)
    for position, (expression, (name, actual)) in enumerate(zip(expressions, backward.items())):
        assert _same(actual, values[expression]), (position, name, expression)
    assert len(grads) == 5 and grads[3:] == (None, ) * 2
    assert all(grad is returned for grad, returned in zip(grads[:3], kernels.returned[1]))


def test_every_backend_has_a_derivative_and_a_served_device():
    assert {device for device, _ in attention_stash._BACKENDS} == {"cpu", "cuda"}
    for _, ops in BACKENDS:
        assert _derivative(ops.op)[2] == f"{ops.op}_backward"
