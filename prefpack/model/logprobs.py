"""Completion-only, chunked log-probabilities.

The LM head is applied only to hidden states whose next token is a completion token, and in chunks, so
that at most ``chunk_size x vocab`` logits (and never more than ``MAX_CHUNK_ELEMENTS``) are alive at once in
forward and in backward (backward recomputes each chunk's logits instead of saving them, except the last chunk's,
which forward keeps so that backward starts with them; the forward's logsumexp works in place).
With 150k vocabularies this is most of the memory of a preference step, hence the custom autograd function. The
head's weight and logit transforms come from ``prefpack.model.head``.
"""

from __future__ import annotations

import torch

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MAX_CHUNK_ELEMENTS",
    "chunk_rows",
    "completion_logprobs",
    "segment_sum",
]

DEFAULT_CHUNK_SIZE = 1024
# Whatever ``chunk_size`` says, a chunk holds at most this many logits (rows x vocabulary): 128 MiB in float32,
# 1024 rows of a 32k vocabulary but 220 of a 152k one. Smaller chunks cost nothing measurable here (the
# matmuls stay [rows, H] x [H, V] with V large) and keep the head's transient memory independent of V.
MAX_CHUNK_ELEMENTS = 1 << 25


def chunk_rows(chunk_size: int, vocab: int, max_elements: int = MAX_CHUNK_ELEMENTS) -> int:
    """Rows per chunk: ``chunk_size``, lowered so that ``rows x vocab <= max_elements`` (at least 1)."""
    return max(1, min(int(chunk_size), int(max_elements) // max(int(vocab), 1)))


def _chunk_bounds(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """``n`` rows cut into the fewest chunks of at most ``chunk_size`` rows, of equal sizes (give or take one), so
    that the chunk forward keeps for backward is as large as the others."""
    count = max(1, -(-n // chunk_size))
    base, extra = divmod(n, count)
    ends = [0]
    for i in range(count):
        ends.append(ends[-1] + base + (i < extra))
    return [(s, e) for s, e in zip(ends[:-1], ends[1:]) if e > s]


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    """Log-probs are float32 at least (float64 stays float64), whatever the model dtype."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Logits of one chunk: matmul in the model dtype (as the model's own head), the rest in float32+."""
    z = h @ weight.t()
    if bias is not None:
        z = z + bias
    z = z.to(out_dtype)
    if scale != 1.0:
        z.mul_(scale)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _matmul_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """Under autocast the head would run in the autocast dtype; otherwise in the wider of h and weight."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, weight.dtype)


def _cast(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return x if x is None or x.dtype == dtype else x.to(dtype)


class _ChunkedTokenLogprob(torch.autograd.Function):
    """log p(target | h) = z[target] - logsumexp(z), z = softcap(scale * (h W^T + b)), chunk by chunk.

    Forward and backward run with autocast off and an explicit matmul dtype recorded in forward, so the
    backward recomputes exactly the forward's logits even though autograd runs it outside autocast.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, targets, chunk_size, scale, softcap, with_log_sum_sq, with_entropy, keep_last):
        mm_dtype = _matmul_dtype(h, weight)
        out_dtype = _out_dtype(mm_dtype)
        n = h.shape[0]
        logp = torch.empty(n, dtype=out_dtype, device=h.device)
        lse = torch.empty(n, dtype=out_dtype, device=h.device)
        log_sum_sq = torch.empty(n if with_log_sum_sq else 0, dtype=out_dtype, device=h.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=out_dtype, device=h.device)
        # The last chunk's logits stay alive for backward (which starts with them, then frees them): one chunk of
        # memory between forward and backward, one matmul fewer in backward. Backward then runs the very same ops
        # on the very same logits as for a recomputed chunk, so gradients do not depend on which chunk was kept.
        ctx.kept = None
        bounds = _chunk_bounds(n, chunk_size)
        with torch.autocast(h.device.type, enabled=False):
            w, b = _cast(weight, mm_dtype), _cast(bias, mm_dtype)
            for i, (s, e) in enumerate(bounds):
                z = _chunk_logits(_cast(h[s:e], mm_dtype), w, b, scale, softcap, out_dtype)
                target_z = z.gather(1, targets[s:e, None]).squeeze(1)
                m = z.amax(dim=1, keepdim=True)
                m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
                keep = keep_last and i == len(bounds) - 1
                # logsumexp in place (torch.logsumexp would allocate a second chunk-sized temporary); a kept chunk
                # is read in row blocks instead, so that z survives with a temporary of an eighth of the chunk
                step = max(1, -(-(e - s) // 8)) if keep else e - s
                for r in range(0, e - s, step):
                    block = z[r:r + step]
                    scaled = (block - m[r:r + step]).exp_() if keep else block.sub_(m).exp_()  # exp(z - m)
                    total = scaled.sum(dim=1)
                    log_total = total.log()
                    lse[s + r:s + r + step] = log_total + m[r:r + step].squeeze(1)
                    if with_log_sum_sq:
                        # log sum_v p_v^2 = 2 log ||exp(z - m)|| - 2 log sum exp(z - m); no temporary for the norm
                        log_sum_sq[s + r:s + r + step] = 2.0 * (
                            torch.linalg.vector_norm(scaled, dim=1).log_() - log_total)
                    if with_entropy:
                        # -sum_v p_v log p_v with p = e / T, e = exp(z - m): log T - sum_v e_v log e_v / T, the
                        # e log e computed in place (the last use of e), so no temporary
                        entropy[s + r:s + r + step] = log_total - scaled.xlogy_(scaled).sum(dim=1) / total
                    del scaled
                logp[s:e] = target_z - lse[s:e]
                if keep:
                    ctx.kept = (s, z)
                del z
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.chunk_size, ctx.scale, ctx.softcap, ctx.mm_dtype = chunk_size, scale, softcap, mm_dtype
        ctx.mark_non_differentiable(log_sum_sq, entropy)
        return logp, log_sum_sq, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_log_sum_sq, _grad_entropy):
        h, weight, bias, targets, lse = ctx.saved_tensors
        chunk_size, scale, softcap, mm_dtype = ctx.chunk_size, ctx.scale, ctx.softcap, ctx.mm_dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n = h.shape[0]
        out_dtype = lse.dtype
        grad_out = grad_out.to(out_dtype)

        grad_h = torch.zeros(h.shape, dtype=h.dtype, device=h.device) if need_h else None
        # Half-precision matmuls: accumulate the chunks' weight gradients in float32, round once at the end.
        acc_dtype = _out_dtype(mm_dtype)
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=out_dtype, device=bias.device) if need_b else None

        kept, ctx.kept = ctx.kept, None  # used once: a second backward (retain_graph) recomputes it
        if need_h or need_w or need_b:
            # last chunk first: the kept one is freed before any other exists, and the weight gradient sums the
            # chunks in one order whether or not a chunk was kept
            bounds = _chunk_bounds(n, chunk_size)[::-1]
            with torch.autocast(h.device.type, enabled=False):
                w, b = _cast(weight, mm_dtype), _cast(bias, mm_dtype)
                for s, e in bounds:
                    hc = _cast(h[s:e], mm_dtype)
                    g = grad_out[s:e, None]
                    # d logp / d z = onehot(target) - softmax(z); without softcap z is not needed again.
                    if kept is not None and kept[0] == s:
                        z, kept = kept[1], None
                    else:
                        z = _chunk_logits(hc, w, b, scale, softcap, out_dtype)
                    dz = z - lse[s:e, None] if softcap is not None else z.sub_(lse[s:e, None])
                    dz.exp_().mul_(-g)
                    dz.scatter_add_(1, targets[s:e, None], g)
                    if softcap is not None:
                        # z = c * tanh(u / c)  =>  dz/du = 1 - (z / c)^2
                        dz.mul_(z.div_(softcap).square_().neg_().add_(1.0))
                    del z
                    if scale != 1.0:
                        dz.mul_(scale)
                    if need_b:
                        grad_b += dz.sum(0)
                    dzc = dz.to(mm_dtype)
                    del dz
                    if need_h:
                        grad_h[s:e] = dzc @ w
                    if need_w:
                        if grad_w.dtype == mm_dtype:
                            grad_w.addmm_(dzc.t(), hc)
                        else:
                            grad_w += dzc.t() @ hc
                    del dzc

        if need_w:
            grad_w = grad_w.to(weight.dtype)
        if need_b:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def completion_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    scale: float = 1.0,
    softcap: float | None = None,
    max_chunk_elements: int | None = None,
    with_log_sum_sq: bool = False,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Per-position ``log p(target)`` from gathered hidden states.

    ``hidden`` [N, H] must already be gathered at the positions whose next token is a completion token
    (gather before the head: prompt positions never meet the vocabulary). ``targets`` [N] are those next
    tokens, ``weight`` [V, H] (+ ``bias`` [V]) the LM head. ``scale`` multiplies the logits and ``softcap``
    applies ``c * tanh(z / c)`` afterwards (Cohere / Granite scaling, Gemma-2 final soft-capping).

    At most ``chunk x V`` logits exist at once in forward and backward, one chunk being ``chunk_size`` rows
    or fewer, so that ``chunk x V <= max_chunk_elements`` (see :func:`chunk_rows`). By default that cap is
    ``MAX_CHUNK_ELEMENTS`` on CPU and none on accelerators, whose chunk size is sized to their memory
    (``prefpack.engine.budgets``): small chunks there leave the device waiting on small kernels. The result is float32
    (float64 for float64 inputs); logsumexp is always computed in that precision, also for bf16 models.

    ``with_log_sum_sq`` also returns, without gradient, ``log sum_v p_v^2`` per position (WPO's weight needs it,
    Zhou et al. 2024 Eq. 2; TRL's ``log_sum_sq_probs``), computed from the same chunk of logits.
    ``with_entropy`` also returns, without gradient, the entropy ``-sum_v p_v log p_v`` of each position's
    distribution, from the same logits (no extra pass over the head). Extras come after ``logp`` in that order.
    """
    if hidden.ndim != 2 or targets.ndim != 1 or hidden.shape[0] != targets.shape[0]:
        raise ValueError(
            f"expected hidden [N, H] and targets [N], got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, {hidden.shape[1]}], got {tuple(weight.shape)}")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if max_chunk_elements is None:
        max_chunk_elements = MAX_CHUNK_ELEMENTS if hidden.device.type == "cpu" else int(chunk_size) * weight.shape[0]
    if int(max_chunk_elements) < 1:
        raise ValueError(f"max_chunk_elements must be >= 1, got {max_chunk_elements}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    logp, log_sum_sq, entropy = _ChunkedTokenLogprob.apply(
        hidden,
        weight,
        bias,
        targets.long(),
        chunk_rows(chunk_size, weight.shape[0], max_chunk_elements),
        float(scale),
        None if softcap is None else float(softcap),
        bool(with_log_sum_sq),
        bool(with_entropy),
        torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad),
    )
    extras = [x for x, on in ((log_sum_sq, with_log_sum_sq), (entropy, with_entropy)) if on]
    return (logp, *extras) if extras else logp


def segment_sum(values: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sum ``values`` [N] into ``num_segments`` buckets given by ``index`` [N] (differentiable, no sync)."""
    out = values.new_zeros(num_segments)
    return out.index_add(0, index.to(device=values.device, dtype=torch.long), values)
