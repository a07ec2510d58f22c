"""Turning tensors into numbers: the registration read from the live objects, a
step's device numbers as one vector, and the step record built from it on the
reporter thread.

Imports only the package's foundation modules (``wire``, ``errors``, ``_log``,
``_env``, ``_torch_compat``); never capture, delivery, the top-level API or the
integrations. Nothing is imported here, so naming a submodule loads only it.
"""
