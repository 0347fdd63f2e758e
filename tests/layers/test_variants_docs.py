"""Every ```python block of docs/variants.md runs, in order, in one namespace; the blocks assert
their own claims (the caches equal the full forward, the combined map's rows sum to ``1 - λ``,
MoBA reads its chosen blocks only, NSA's decode steps equal its forward, the top-k layer
reads k keys),
and the main ones are re-checked here, so that they hold under ``python -O`` too."""

import math
import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "variants.md"


def test_the_page_runs_and_its_claims_hold():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 5
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    assert namespace["layer"].lambda_init == 0.8 - 0.6 * math.exp(-0.6)
    lam = namespace["lam"].detach()
    torch.testing.assert_close(namespace["w"].sum(-1), (1 - lam).expand(2, 4, 24))
    torch.testing.assert_close(torch.cat(namespace["steps"], dim=1), namespace["y"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(namespace["moba_steps"], dim=1), namespace["ym"], atol=1e-5, rtol=1e-5)
    assert bool(((namespace["wm"][:, :, 20] > 0).sum(-1) == 5).all())
    torch.testing.assert_close(torch.cat(namespace["nsa_steps"], dim=1), namespace["yn"], atol=1e-5, rtol=1e-5)
    assert bool(((namespace["wt"][:, :, 20] > 0).sum(-1) == 6).all())
