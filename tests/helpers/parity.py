"""Shorthands of the OpenRLHF parity tests (tests/unit/test_parity_*.py): ``T`` builds a tensor, ``close`` compares in
float64 within ``tol`` and prints both sides."""
import torch

T = torch.tensor
NAN = float("nan")


def close(a, b, tol=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape and torch.allclose(a, b, atol=tol), f"got {a.tolist()}, expected {b.tolist()}"
