"""Stand-ins of the CUDA packages transformers binds for the recurrent layers, with the real functions' signatures
(flash-linear-attention's ``chunk_gated_delta_rule``, causal-conv1d's ``causal_conv1d_fn``, mamba_ssm's
``mamba_chunk_scan_combined`` and ``mamba_split_conv1d_scan_combined``, as of fla 0.3 / causal-conv1d 1.5 /
mamba_ssm 2.2) and their semantics written out as plain float64 loops: a sequence boundary (``cu_seqlens``,
``seq_idx``) restarts the state and the convolution window, as the kernels do.

:func:`install` puts them where transformers looks the packages up (``sys.modules``, then its
``use_kernel_func_from_hub_with_fallback`` binding each modeling module's functions again, with its keyword
filtering by the stand-in's signature), so a CPU forward takes the same path as a CUDA one with those packages.
Every call is recorded in :data:`CALLS` (name, the boundary argument it got).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

import torch
import torch.nn.functional as F

CALLS: list[tuple[str, torch.Tensor | None]] = []


def _act(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    assert activation in (None, "silu", "swish")
    return x if activation is None else F.silu(x)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """x [B, D, L], weight [D, W]: a depthwise causal convolution whose window never reads a token of another
    sequence (``seq_idx`` [B, L] int32)."""
    CALLS.append(("causal_conv1d_fn", seq_idx))
    assert initial_states is None and not return_final_states
    width, length = weight.shape[1], x.shape[-1]
    xd, wd = x.double(), weight.double()
    out = torch.zeros_like(xd) if bias is None else bias.double()[None, :, None].expand_as(xd).clone()
    for lag in range(width):  # tap ``lag`` reads the token ``lag`` steps back
        shifted = F.pad(xd, (lag, 0))[..., :length]
        if seq_idx is not None:
            before = F.pad(seq_idx.long(), (lag, 0), value=-1)[..., :length]
            shifted = shifted * (before == seq_idx.long())[:, None]
        out = out + wd[:, width - 1 - lag][None, :, None] * shifted
    return _act(out, activation).to(x.dtype)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """q, k [B, T, Hk, K], v [B, T, Hv, V], g, beta [B, T, Hv] -> (o [B, T, Hv, V], final state or None). With
    ``cu_seqlens`` (int32 [N + 1]) the batch must be 1 (fla refuses otherwise) and each of the N sequences starts
    from a zero state. The delta rule token by token: S <- S * exp(g); S <- S + k (beta (v - S^T k))^T;
    o = S^T q * scale."""
    CALLS.append(("chunk_gated_delta_rule", cu_seqlens))
    assert initial_state is None and not output_final_state
    batch, length, heads_k, dim_k = k.shape
    heads_v = v.shape[2]
    if cu_seqlens is not None:
        assert batch == 1, "fla takes cu_seqlens with a batch of 1 only"
        bounds = cu_seqlens.tolist()
    else:
        bounds = [0, length]
    qd, kd = (t.double().repeat_interleave(heads_v // heads_k, dim=2) for t in (q, k))
    if use_qk_l2norm_in_kernel:
        qd, kd = (t * torch.rsqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in (qd, kd))
    qd = qd * (dim_k ** -0.5 if scale is None else scale)
    vd, gd, bd = v.double(), g.double(), beta.double()
    outs = []
    for b in range(batch):
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            state = vd.new_zeros(heads_v, dim_k, vd.shape[-1])
            for t in range(start, end):
                state = state * gd[b, t].exp()[:, None, None]
                delta = (vd[b, t] - torch.einsum("hkv,hk->hv", state, kd[b, t])) * bd[b, t][:, None]
                state = state + kd[b, t][:, :, None] * delta[:, None, :]
                outs.append(torch.einsum("hkv,hk->hv", state, qd[b, t]))
    return torch.stack(outs).view(batch, length, heads_v, -1).to(v.dtype), None


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    """x [b, L, H, P], dt [b, L, H], A [H], B, C [b, L, G, N] -> y [b, L, H, P]: the selective scan
    h <- exp(dt A) h + dt x B^T, y = h C + D x (times silu(z)), restarted where ``seq_idx`` changes."""
    CALLS.append(("mamba_chunk_scan_combined", seq_idx))
    assert initial_states is None and not return_final_states and not return_varlen_states
    batch, length, heads, _ = x.shape
    dtd = dt.double() + (0 if dt_bias is None else dt_bias.double())
    dtd = F.softplus(dtd) if dt_softplus else dtd
    dtd = dtd.clamp(dt_limit[0], dt_limit[1])
    Bd, Cd = (t.double().repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))
    xd, Ad = x.double(), A.double()
    state = xd.new_zeros(batch, heads, x.shape[3], B.shape[3])
    ys = []
    for t in range(length):
        if seq_idx is not None and t > 0:
            state = state * (seq_idx[:, t] == seq_idx[:, t - 1]).double()[:, None, None, None]
        state = state * (dtd[:, t] * Ad).exp()[..., None, None] \
            + (dtd[:, t, :, None] * xd[:, t])[..., None] * Bd[:, t, :, None, :]
        y = (state * Cd[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + xd[:, t] * (D.double()[:, None] if D.dim() == 1 else D.double())
        ys.append(y)
    y = torch.stack(ys, dim=1)
    if z is not None:
        y = y * F.silu(z.double())
    return y.to(x.dtype)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    """The fused Mamba-2 mixer training takes: split [z, xBC, dt], the convolution, the scan, the gated group
    RMSNorm, the output projection; ``seq_idx`` reaches both the convolution and the scan."""
    CALLS.append(("mamba_split_conv1d_scan_combined", seq_idx))
    assert initial_states is None and not return_final_states
    heads = D.shape[0]
    headdim = headdim if D.dim() == 1 else D.shape[1]
    batch, length, _ = zxbcdt.shape
    dim = heads * headdim
    state = (conv1d_weight.shape[0] - dim) // ngroups // 2
    assert zxbcdt.shape[-1] == 2 * dim + 2 * ngroups * state + heads, "an MLP part (d_nonssm) is not modelled"
    z, xbc, dt = zxbcdt.split([dim, dim + 2 * ngroups * state, heads], dim=-1)
    xbc = causal_conv1d_fn(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                           activation=activation).transpose(1, 2)
    x, b, c = xbc.split([dim, ngroups * state, ngroups * state], dim=-1)
    y = mamba_chunk_scan_combined(x.reshape(batch, length, heads, headdim), dt, A,
                                  b.reshape(batch, length, ngroups, state), c.reshape(batch, length, ngroups, state),
                                  chunk_size, D=D, z=None if rmsnorm_weight is not None else
                                  z.reshape(batch, length, heads, headdim), dt_bias=dt_bias, seq_idx=seq_idx,
                                  dt_softplus=True, dt_limit=dt_limit).reshape(batch, length, dim).double()
    if rmsnorm_weight is not None:
        gate = F.silu(z.double())
        y = y if norm_before_gate else y * gate
        grouped = y.view(batch, length, ngroups, dim // ngroups)
        y = (grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + rmsnorm_eps)).view(batch, length, dim)
        y = y * rmsnorm_weight.double()
        y = y * gate if norm_before_gate else y
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight.double(), None if outproj_bias is None else outproj_bias.double())
    return y.to(zxbcdt.dtype)


# import path -> the stand-ins it holds (the paths transformers' hub_kernels resolves)
_MODULES = {
    "fla": {}, "fla.ops": {}, "fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": chunk_gated_delta_rule},
    "causal_conv1d": {"causal_conv1d_fn": causal_conv1d_fn},
    "mamba_ssm": {}, "mamba_ssm.ops": {}, "mamba_ssm.ops.triton": {},
    "mamba_ssm.ops.triton.ssd_combined": {"mamba_chunk_scan_combined": mamba_chunk_scan_combined,
                                          "mamba_split_conv1d_scan_combined": mamba_split_conv1d_scan_combined},
}

# modeling module -> its global bound by use_kernel_func_from_hub_with_fallback -> (function name, package)
BINDINGS = {
    "transformers.models.qwen3_5.modeling_qwen3_5": {
        "causal_conv1d_fn": ("causal_conv1d_fn", "causal_conv1d"),
        "torch_chunk_gated_delta_rule": ("chunk_gated_delta_rule", "fla")},
    "transformers.models.nemotron_h.modeling_nemotron_h": {
        "causal_conv1d_fn": ("causal_conv1d_fn", "causal_conv1d"),
        "mamba2_chunk_scan": ("mamba_chunk_scan_combined", "mamba_ssm"),
        "mamba2_split_conv1d_scan_combined": ("mamba_split_conv1d_scan_combined", "mamba_ssm")},
}


def install(monkeypatch) -> None:
    """The stand-in packages in ``sys.modules`` and the modeling modules' functions bound to them by transformers'
    own decorator (undone by ``monkeypatch``)."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    for name, functions in _MODULES.items():
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__dict__.update(functions)
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    for path, globals_ in BINDINGS.items():
        modeling = importlib.import_module(path)
        for attribute, (function, package) in globals_.items():
            torch_function = getattr(modeling, attribute).__wrapped__
            monkeypatch.setattr(modeling, attribute,
                                use_kernel_func_from_hub_with_fallback(function, package)(torch_function))
