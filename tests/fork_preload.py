"""The first module the fork server of :func:`tests.helpers.forked_recipe` imports: bitsandbytes made unimportable, as
``python recipes/finetune_llm.py`` makes it for a run that does not quantize (:func:`dpllm.quantization.
hide_unused_bitsandbytes`; no forked run quantizes), before the server's other modules import peft, which would import
it (through torch.compile: ~2.7 CPU-s). The forked recipe processes then hold what a recipe process holds."""

from dpllm.quantization import hide_unused_bitsandbytes

hide_unused_bitsandbytes("none", "tiny-llama")
