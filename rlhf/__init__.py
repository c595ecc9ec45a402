"""rlhf: torchrun-native RLHF training (PPO, GRPO, RLOO, REINFORCE++, DPO, RM, SFT) without Ray."""
import os as _os

__version__ = "0.1.0"

# transformers' hub kernels stay off unless the user turns them on (USE_HUB_KERNELS=1 wins: setdefault).
# transformers >= 5.2x defaults ``from_pretrained(use_kernels=None)`` to True when the ``kernels`` package is
# installed and USE_HUB_KERNELS is unset (transformers/modeling_utils.py ``from_pretrained``: "elif use_kernels is
# None: use_kernels = True"; integrations/hub_kernels.py ``_kernels_enabled``), and then ``model.train()``
# re-kernelizes on the device it reads from the parameters (kernels ``kernelize``: "Unsupported device type" for
# meta, the host under --adam_offload), replaces layers with kernels fetched from the hub (an offline compute node
# cannot), and changes the numbers against OpenRLHF's and our parity checks.  Set before transformers is imported:
# older versions read the variable once, at import (transformers 5.19 ``_TRANSFORMERS_USE_HUB_KERNELS``).
_os.environ.setdefault("USE_HUB_KERNELS", "0")
