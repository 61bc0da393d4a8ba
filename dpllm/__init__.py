"""dpllm: differentially private fine-tuning of Hugging Face language models.

plan → train → audit → fit. Importing this package has no side effects.
"""

__version__ = "0.1.0"
