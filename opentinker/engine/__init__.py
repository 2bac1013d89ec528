"""The engine: one base model per device, many adapters, sampling and training.

The only package of the runtime that imports torch, transformers and peft (besides
``learners``). See ``docs/architecture.md``.
"""
