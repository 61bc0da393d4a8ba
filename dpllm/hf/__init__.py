"""Hugging Face integration: a DP ``transformers.Trainer`` whose output directory is a dpllm run.

    from dpllm.hf import DPTrainer, PrivacyArguments

    trainer = DPTrainer(model=model, args=training_args, privacy_args=PrivacyArguments(target_epsilon=8),
                        train_dataset=train, eval_dataset=heldout, processing_class=tokenizer)
    trainer.train()
    trainer.model.generate(...)

See :mod:`dpllm.hf.trainer` for what runs, :mod:`dpllm.hf.arguments` for what is refused and why, and
``recipes/hf_trainer_example.py`` for a complete script.
"""

from dpllm.hf.arguments import PrivacyArguments, refuse_unsafe
from dpllm.hf.trainer import DPTrainer

__all__ = ["DPTrainer", "PrivacyArguments", "refuse_unsafe"]
