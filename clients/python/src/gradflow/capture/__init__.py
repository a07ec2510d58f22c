"""What runs on the training thread: the hooks and wrappers gradflow attaches to the
user's model, optimizer and scaler, and the step they drive (:mod:`.instrument`).

Imports :mod:`gradflow.measurement` and the package's foundation modules (``wire``,
``errors``, ``_log``, ``_env``, ``_torch_compat``); never the top-level API, delivery
or the integrations. Nothing is imported here, so naming a submodule loads only it.
"""
