"""Clip modes by name: the registry a config's ``clip_mode`` string is looked up in.

Keys are plain strings; the built-in modes register under the values of ``calclip.losses.ClipMode`` (the Enum that
has named them since before this package), so a built-in key cannot be misspelt at registration. An unknown name
raises ValueError listing the registered keys; registering a taken name raises. A new mode is one module with a
``ClipPolicy`` subclass decorated ``@register_clip_mode``, imported by ``calclip/clipping/__init__.py``.
"""

from __future__ import annotations

from calclip.clipping.policy import ClipPolicy

_MODES: dict[str, type[ClipPolicy]] = {}


def register_clip_mode(cls: type[ClipPolicy]) -> type[ClipPolicy]:
    """Class decorator: register ``cls`` under ``cls.name``. A name already taken raises ValueError."""
    if not (isinstance(cls, type) and issubclass(cls, ClipPolicy)):
        raise TypeError(f"a clip mode is a ClipPolicy subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__}.name must be a non-empty string (its clip_mode key), got {name!r}")
    name = str.__str__(name)  # a ClipMode member is stored as its plain value
    if name in _MODES:
        raise ValueError(f"clip mode {name!r} is already registered (by {_MODES[name].__name__})")
    _MODES[name] = cls
    cls.name = name
    return cls


def unregister_clip_mode(name: str) -> None:
    """Remove a registered mode (tests register toy modes and remove them again)."""
    if name not in _MODES:
        raise ValueError(f"clip mode {name!r} is not registered; registered: {registered_clip_modes()}")
    del _MODES[name]


def registered_clip_modes() -> tuple[str, ...]:
    """Every registered key, in registration order (the built-in modes first)."""
    return tuple(_MODES)


def clip_mode_class(name: str, *, field: str = "clip_mode") -> type[ClipPolicy]:
    """The ClipPolicy subclass registered as ``name``; an unknown name raises ValueError naming ``field`` and the
    registered keys."""
    try:
        return _MODES[name]
    except (KeyError, TypeError):  # TypeError: an unhashable value from YAML
        raise ValueError(f"{field} must be one of {registered_clip_modes()}, got {name!r}") from None


def clip_policy_from_fields(clip_mode: str, *, epsilon: float, epsilon_high: float,
                            dual_clip_c: float | None = None) -> ClipPolicy:
    """The clip policy a run holds, from the config's plain values: ``epsilon_high`` is the upper epsilon in force
    (a config's None already resolved)."""
    return clip_mode_class(clip_mode)(eps_low=epsilon, eps_high=epsilon_high, dual_clip_c=dual_clip_c)
