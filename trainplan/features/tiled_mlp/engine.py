"""The tiled MLP in the engine (features/tiled_mlp): each decoder layer's `mlp` runs through _TiledMLP, whose
backward recomputes and backpropagates one tile of the sequence at a time. The trainable parameters the MLP
reads (a full fine-tune's weights, LoRA's adapters) are inputs of the autograd node, so their gradients arrive
once a step through autograd, where DDP's and FSDP2's hooks wait for them."""

from __future__ import annotations

import torch
from torch import nn

from trainplan.features import tiled_mlp
from trainplan.run.converter import Build, decoder_layers


def _autocast_state(device: str):
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mlp: nn.Module, n: int, *params: torch.Tensor) -> torch.Tensor:
        # x (batch, seq, hidden): the MLP's input, the one tensor kept for backward
        ctx.mlp, ctx.n, ctx.count = mlp, n, len(params)
        ctx.device = x.device.type
        ctx.autocast = _autocast_state(ctx.device)
        ctx.rng = torch.get_rng_state(), torch.cuda.get_rng_state() if x.is_cuda else None  # dropout, replayed
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return _tiles_without_grad(mlp, x, n)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *params = ctx.saved_tensors
        want_x = ctx.needs_input_grad[0]
        x_grad = torch.empty_like(x) if want_x else None
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        cast = (
            torch.autocast(ctx.device, dtype=ctx.autocast)
            if ctx.autocast is not None
            else torch.autocast(ctx.device, enabled=False)
        )
        devices = [torch.cuda.current_device()] if ctx.rng[1] is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"):
            torch.set_rng_state(ctx.rng[0])
            if ctx.rng[1] is not None:
                torch.cuda.set_rng_state(ctx.rng[1])
            at = 0
            for part, part_grad in zip(x.chunk(ctx.n, dim=-2), grad.chunk(ctx.n, dim=-2), strict=True):
                part = part.detach().requires_grad_(want_x)
                with torch.enable_grad(), cast:
                    y = ctx.mlp.forward_whole(part)
                inputs = ([part] if want_x else []) + params
                grads = torch.autograd.grad(y, inputs, part_grad, allow_unused=True)
                del y
                if want_x:
                    x_grad.narrow(-2, at, part.shape[-2]).copy_(grads[0])
                    grads = grads[1:]
                for i, g in enumerate(grads):
                    if g is not None:
                        param_grads[i] = g if param_grads[i] is None else param_grads[i].add_(g)
                at += part.shape[-2]
        ctx.mlp = None
        return x_grad, None, None, *param_grads


def _tiles_without_grad(mlp: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
    out, at = None, 0
    for part in x.chunk(n, dim=-2):
        y = mlp.forward_whole(part)
        if out is None:
            out = y.new_empty((*x.shape[:-1], y.shape[-1]))
        out.narrow(-2, at, y.shape[-2]).copy_(y)
        at += y.shape[-2]
        del y
    return out


def tile(mlp: nn.Module, hidden_size: int) -> None:
    """Make `mlp`'s forward the tiled one; its own stays as forward_whole (one tile's)."""
    mlp.forward_whole = mlp.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved; a tile's intermediates at a time
            if not mlp.training and x.shape[-2] > hidden_size:
                return _tiles_without_grad(mlp, x, tiled_mlp.tiles(x.shape[-2], hidden_size))
            return mlp.forward_whole(x)
        params = [p for p in mlp.parameters() if p.requires_grad]
        return _TiledMLP.apply(x, mlp, tiled_mlp.tiles(x.shape[-2], hidden_size), *params)

    mlp.forward = forward


def apply(model: nn.Module, b: Build) -> nn.Module:
    """The engine's converter: every decoder layer's MLP tiled (memory.tiled_mlp, training only)."""
    if tiled_mlp.on(b.cfg) and b.cfg.mode != "inference":
        for layer in decoder_layers(model):
            tile(layer.mlp, b.spec.hidden_size)
    return model
