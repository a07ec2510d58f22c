"""Integrations with training frameworks: ``gradflow.integrations.transformers``."""
