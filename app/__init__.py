"""eft: Ray-native elastic fine-tuning."""

import logging


class _DropTorchaoImportNoise(logging.Filter):
    # PEFT imports torchao (the QLoRA dependency) to probe its version. On a machine without CUDA or
    # Triton, torchao's import warns that its GPU kernels did not load, and torch warns about the
    # enums it registers: noise on every command, nothing a user can act on. NF4 needs neither.
    def filter(self, record: logging.LogRecord) -> bool:
        return "register_constant() on Enum subclasses" not in record.getMessage()


logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").addFilter(_DropTorchaoImportNoise())

# One warning, at import, when Ray or torch is outside the versions eft's private-API shims were
# checked on (app/compat.py).
from app.compat import check_versions  # noqa: E402

check_versions()
