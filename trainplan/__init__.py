"""trainplan: plan, run and verify LLM fine-tuning, device by device."""

__version__ = "0.1.0"
