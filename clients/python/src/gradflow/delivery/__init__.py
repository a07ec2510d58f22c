"""Off the training thread: the reporter thread, the transport, the spool, and what
the person running training is told (alerts, what could not be delivered).

Knows nothing of torch. Imports only the package's foundation modules (``wire``,
``errors``, ``_log``, ``_env``); never capture, measurement, the top-level API or the
integrations. Nothing is imported here, so naming a submodule loads only it.
"""
