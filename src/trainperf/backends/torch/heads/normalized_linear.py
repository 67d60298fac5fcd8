"""cos = normalize(e) @ normalize(W)^T without a normalised copy of the class matrix.

For [C, D] class rows the plain composition allocates W / |W| in the forward, keeps it for the
backward, and normalisation's backward makes several more [C, D] temporaries. Here the row norms
scale the [N, C] product instead, and the weight gradient is formed in place:

    cos_ij = (e_i . w_j) / n_j,   dL/dw_j = M_j / n_j - (M_j . w_j) w_j / n_j^3,   M = G^T e

so one [C, D] tensor (the gradient itself) is allocated, and nothing of that size is saved.
Embeddings are expected normalised already (they are [N, D], small).
"""

from __future__ import annotations

import torch

EPS = 1e-12  # as F.normalize


def _compute_dtype(device: torch.device) -> torch.dtype | None:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


class _NormalizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(fctx, emb: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        inv_norm = weight.detach().norm(dim=1).clamp_min(EPS).reciprocal()
        dtype = _compute_dtype(emb.device)
        e, w = (emb, weight) if dtype is None else (emb.to(dtype), weight.to(dtype))
        cos = torch.mm(e, w.t())
        cos.mul_(inv_norm.to(cos.dtype)[None, :])
        fctx.save_for_backward(emb, weight, inv_norm)
        fctx.dtype = dtype
        return cos

    @staticmethod
    def backward(fctx, grad: torch.Tensor):
        emb, weight, inv_norm = fctx.saved_tensors
        dtype = fctx.dtype
        e, w = (emb, weight) if dtype is None else (emb.to(dtype), weight.to(dtype))
        g = grad.to(e.dtype)
        grad_emb = grad_weight = None
        if fctx.needs_input_grad[0]:
            grad_emb = torch.mm(g * inv_norm.to(g.dtype)[None, :], w).to(emb.dtype)
        if fctx.needs_input_grad[1]:
            m = torch.mm(g.t(), e).to(weight.dtype)  # [C, D], becomes the gradient in place
            # Row dots m_j . w_j as a batched [1, D] x [D, 1] product: no [C, D] temporary.
            dots = torch.bmm(m.unsqueeze(1), weight.unsqueeze(2)).view(-1)
            coef = -(inv_norm ** 3) * dots
            grad_weight = m.mul_(inv_norm[:, None]).addcmul_(weight, coef[:, None])
        return grad_emb, grad_weight


def normalized_linear(emb: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Cosines [N, C] between normalised embeddings [N, D] and the rows of ``weight`` [C, D]."""
    return _NormalizedLinear.apply(emb, weight)
