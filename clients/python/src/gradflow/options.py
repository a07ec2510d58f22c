"""What ``gradflow.watch`` was asked for, resolved once: arguments first, then the
``GRADFLOW_*`` environment, then the defaults. Nothing here touches torch or the
network, so every setting is checked before anything is attached to the user's
objects."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union, cast

from . import _env, wire
from .delivery.alerts import MODES
from .measurement.signals import SignalSettings

DEFAULT_CLOSE_TIMEOUT = 15.0
DEFAULT_SPOOL_MAX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class WatchOptions:
    """Every setting of one watched run except the objects watched and its id."""

    servers: List[str]
    token: Optional[str] = None
    name: Optional[str] = None
    every: int = 1
    groups: Any = None  # layout.GroupsArg
    on_alert: Optional[str] = "warn"
    detectors: Optional[Dict[str, int]] = None
    train: Optional[List[str]] = None
    config: Any = None
    queue_size: int = 1024
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT
    spool_dir: Optional[str] = None
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    updates_every: int = 10
    webhooks: Optional[List[wire.Webhook]] = None
    signals: SignalSettings = SignalSettings()

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be at least 1, got {self.every}")
        if self.on_alert not in MODES:
            raise ValueError(f"on_alert must be 'warn', 'raise' or None, got {self.on_alert!r}")

    @classmethod
    def resolve(
        cls,
        *,
        server: Union[None, str, Sequence[str]] = None,
        token: Optional[str] = None,
        name: Optional[str] = None,
        every: int = 1,
        groups: Any = None,
        on_alert: Optional[str] = "warn",
        detectors: Optional[Mapping[str, int]] = None,
        train: Optional[List[str]] = None,
        config: Any = None,
        queue_size: int = 1024,
        close_timeout: Optional[float] = None,
        spool_dir: Optional[str] = None,
        spool_max_bytes: Optional[int] = None,
        updates_every: int = 10,
        webhooks: Any = None,
        signals: Any = None,
        signal_modules: Any = None,
    ) -> WatchOptions:
        """The options of ``watch``'s arguments, the environment filling what is left
        out; raises ValueError or TypeError for a wrong one."""
        return cls(
            servers=_env.servers(server),
            token=_env.token(token),
            name=name,
            every=int(every),
            groups=groups,
            on_alert=on_alert,
            detectors=dict(detectors) if detectors else None,
            train=train,
            config=config,
            queue_size=queue_size,
            close_timeout=close_timeout
            if close_timeout is not None
            else _env.float_env("GRADFLOW_CLOSE_TIMEOUT", DEFAULT_CLOSE_TIMEOUT),
            spool_dir=spool_dir or os.environ.get("GRADFLOW_SPOOL_DIR"),
            spool_max_bytes=spool_max_bytes
            or int(_env.float_env("GRADFLOW_SPOOL_MAX_BYTES", DEFAULT_SPOOL_MAX_BYTES)),
            updates_every=int(updates_every),
            webhooks=webhook_specs(webhooks),
            signals=SignalSettings.resolve(signals, signal_modules),
        )


def webhook_specs(webhooks: Any) -> Optional[List[wire.Webhook]]:
    """The registration's ``webhooks`` from what :func:`gradflow.watch` was given: a
    URL string (Slack's incoming-webhook URLs get Slack's body, others the generic
    one) or a dict with ``url``, ``format`` and ``min_severity`` as in the protocol."""
    if webhooks is None:
        return None
    if isinstance(webhooks, (str, dict)):
        webhooks = [webhooks]
    specs: List[wire.Webhook] = []
    for hook in webhooks:
        if isinstance(hook, str):
            slack = hook.startswith("https://hooks.slack.com/")
            specs.append({"url": hook, "format": "slack"} if slack else {"url": hook})
        elif isinstance(hook, dict) and isinstance(hook.get("url"), str):
            specs.append(cast(wire.Webhook, dict(hook)))
        else:
            raise TypeError(
                f"webhooks: {hook!r} is neither a URL nor a dict with a 'url' "
                "(and optionally 'format': 'generic' | 'slack', 'min_severity')"
            )
    return specs
