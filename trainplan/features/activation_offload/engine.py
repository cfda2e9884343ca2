"""memory.offload_activations: what the decoder layers keep for backward goes to host memory as forward saves
it, and comes back to the device for the backward that uses it: a plain layer's saved tensors, and a checkpointed
layer's input (ALST's checkpoints in host memory), which comes back for the layer's recompute.

torch's saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`), the mechanism of
`torch.autograd.graph.save_on_cpu`, with four differences the plan relies on (plan/terms.py
`activations`):
- a parameter, or a view or autocast copy of one, stays where it is: it is no activation, and the
  device keeps it anyway (save_on_cpu would copy every layer's weights to the host on every step);
- a layer's inputs other than its hidden states (rotary cos/sin, the mask) stay: every layer shares
  them;
- a storage is copied once per layer however many of its views are saved, whole, so the host holds
  what the device would have (a view that keeps a larger tensor alive keeps all of it);
- its views share one device copy while any of them is back on the device.

On the CPU the host is the device: the hooks pass each tensor through and only count its bytes, the
figure the plan's `offloaded_activation_bytes` predicts. `copy_on_host=True` copies there too (tests).
On CUDA, "pinned" host buffers make the copies asynchronous; pageable ones (true) wait for each copy.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from trainplan import _torch_private as P
from trainplan.features import activation_offload
from trainplan.run.converter import Build, decoder_layers

_ATTR = "_trainplan_activation_offload"


class _Packed:
    """One storage's host copy, and the device copy its views share while any of them is unpacked."""

    __slots__ = ("host", "device_copy")

    def __init__(self, host) -> None:
        self.host = host
        self.device_copy = None  # a weak reference to a tensor on the device copy


class ActivationOffload:
    """The hooks on a model's decoder layers. `peak_bytes`: the most one forward passed to the host
    (each micro-batch's backward releases its own before the next forward)."""

    def __init__(self, *, pin_memory: bool, copy_on_host: bool = False) -> None:
        self.pin_memory = pin_memory
        self.copy_on_host = copy_on_host
        self.forward_bytes = 0  # this forward's, so far
        self.peak_bytes = 0
        self._first: nn.Module | None = None
        self._stack: list = []

    def install(self, layers: list[nn.Module], checkpointed: list[nn.Module] = ()) -> None:
        """Hooks on the plain `layers`; the `checkpointed` ones (their input is what torch's checkpoint keeps,
        saved before the layer's own forward hooks run) get them around the checkpoint's call instead."""
        every = [*checkpointed, *layers]
        if not every:
            return
        self._first = every[0]
        for layer in layers:
            layer.register_forward_pre_hook(self._enter, with_kwargs=True)
            layer.register_forward_hook(self._exit, always_call=True)
        for layer in checkpointed:
            layer._gradient_checkpointing_func = self._around(layer, layer._gradient_checkpointing_func)

    def _around(self, layer: nn.Module, checkpoint):
        """The layer's checkpoint function with the hooks on while it saves the layer's input; inside, the
        checkpoint's own hooks take what the forward saves (and drop it)."""

        def call(function, *args, **kwargs):
            if layer is self._first:
                self.forward_bytes = 0
            packed: dict[int, tuple] = {}
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, set(), packed), self._unpack):
                out = checkpoint(function, *args, **kwargs)
            packed.clear()
            return out

        return call

    def reset_peak(self) -> None:
        self.peak_bytes = 0

    def _enter(self, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        if layer is self._first:
            self.forward_bytes = 0
        # the layer's inputs but the hidden states stay on the device, and so do its own parameters:
        # those are read at its first saved tensor, when FSDP2 has gathered them
        stay: set[int] = set()
        inputs = [*args[1:], *kwargs.values()] if args else [v for k, v in kwargs.items() if k != "hidden_states"]
        for value in inputs:
            for t in value if isinstance(value, tuple | list) else (value,):
                if isinstance(t, torch.Tensor) and not P.is_fake(t):
                    stay.add(t.untyped_storage().data_ptr())
        packed: dict[int, tuple] = {}  # storage -> (the device tensor, _Packed), for this layer's forward
        params: list[set[int]] = []

        def pack(t: torch.Tensor):
            if not params:
                params.append(stay | {p.untyped_storage().data_ptr() for p in layer.parameters() if not P.is_fake(p)})
            return self._pack(t, params[0], packed)

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)
        hooks.__enter__()
        self._stack.append((hooks, packed))

    def _exit(self, layer: nn.Module, args, output) -> None:
        if not self._stack:  # an earlier pre-hook (FSDP2's) raised before ours ran
            return
        hooks, packed = self._stack.pop()
        hooks.__exit__(None, None, None)
        packed.clear()  # the device tensors this layer's forward saved are the device's to free now

    def _pack(self, t: torch.Tensor, stay: set[int], packed: dict):
        if P.is_fake(t):  # the traced plan's tensors: no memory to move (and no address)
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if not storage.nbytes() or key in stay or P.derives_from_parameter(t):
            return t
        if key not in packed:
            # the device tensor is held until the layer's forward ends, so no later tensor of this
            # forward can take its address and be mistaken for it
            self.forward_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.forward_bytes)
            host = storage
            if t.device.type != "cpu" or self.copy_on_host:
                pin = self.pin_memory and t.device.type == "cuda"
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage()
                host.copy_(storage, non_blocking=pin)
            packed[key] = (t, _Packed(host))
        return packed[key][1], t.device, t.dtype, t.shape, t.stride(), t.storage_offset()

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        slot, device, dtype, shape, stride, offset = saved
        alive = slot.device_copy() if slot.device_copy is not None else None
        if alive is not None:  # another view of the storage is back on the device: share its copy
            storage = alive.untyped_storage()
        elif device.type != "cpu" or self.copy_on_host:
            storage = torch.UntypedStorage(slot.host.nbytes(), device=device)
            storage.copy_(slot.host, non_blocking=self.pin_memory and device.type == "cuda")
        else:
            storage = slot.host
        out = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)
        slot.device_copy = weakref.ref(out)
        return out


def install(model: nn.Module, layers: list[nn.Module], kind: str, checkpointed=()) -> ActivationOffload:
    """Offload the saved tensors of `layers` (those not checkpointed) and the kept inputs of the `checkpointed`
    ones; kind: "pageable" or "pinned"."""
    offload = ActivationOffload(pin_memory=kind == "pinned")
    offload.install(layers, checkpointed)
    setattr(model, _ATTR, offload)
    return offload


def of(model: nn.Module) -> ActivationOffload | None:
    """The model's activation offload, through DDP's and PEFT's wrappers; None where it has none."""
    for m in (model, getattr(model, "module", None)):
        found = getattr(m, _ATTR, None) if m is not None else None
        if found is not None:
            return found
    return None


def apply(model: nn.Module, b: Build) -> nn.Module:
    """The engine's converter: the layers not checkpointed pass their saved tensors to the host."""
    moved = activation_offload.kind(b.cfg)
    if moved:
        ac = b.cfg.memory.activation_checkpointing
        layers = decoder_layers(model)
        ck = b.spec.num_layers if ac is True else int(ac)
        install(model, layers[ck:], moved, checkpointed=layers[:ck])
    return model
