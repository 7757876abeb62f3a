"""Configuration: the typed schema registered with Hydra (``schema``) and the start-up checks (``checks``).

Owns every config key, its default and its validation; the shared constant tables (``constants``);
the supported torch and transformers versions, checked by ``import nodetrain`` (``versions``).
Must not import any other nodetrain subsystem: config sits on the bottom floor, with ``store``.
"""
