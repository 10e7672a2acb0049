"""Reading preset files strictly: YAML with the plain scalars of YAML 1.2, no duplicate keys, no aliases.

PyYAML follows YAML 1.1, where ``10:26`` is the base-60 integer 626, ``017`` is octal 15, ``0x1f`` is 31 and
``yes``/``on`` are booleans: a preset saying ``anchor_steps: 10:26`` would silently anchor every 626 steps.
Here integers are decimal, booleans are ``true``/``false``, everything else stays a string (and the field's
own validation names it). A repeated key is an error instead of the last one winning, and aliases are
refused (nested aliases expand a few hundred bytes into tens of megabytes). Errors are ``ValueError``
naming the file.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

MAX_BYTES = 1 << 20  # a preset is a few hundred bytes; anything near this is not one

_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_BOOL = "tag:yaml.org,2002:bool"


class StrictLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core scalars, refusing duplicate keys and aliases."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"aliases (*{event.anchor}) are not allowed in a preset",
                                              event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {str(key)[:60]!r}",
                                                        key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in rules if tag not in (_INT, _FLOAT, _BOOL)]
    for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}
StrictLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
StrictLoader.add_implicit_resolver(_INT, re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
StrictLoader.add_implicit_resolver(
    _FLOAT, re.compile(r"^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))
StrictLoader.add_constructor(_INT, lambda loader, node: int(loader.construct_scalar(node), 10))
StrictLoader.add_constructor(_BOOL, lambda loader, node: loader.construct_scalar(node).lower() == "true")


def read_yaml(path: str | Path):
    """The document of a preset file (any YAML value), read strictly. ValueError naming the file when it cannot
    be read, is larger than MAX_BYTES, is not UTF-8 or is not valid strict YAML."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{path.name}: cannot read preset ({exc.strerror or exc})") from None
    if len(raw) > MAX_BYTES:
        raise ValueError(f"{path.name}: larger than {MAX_BYTES // 1024} KiB, not a preset")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path.name}: not UTF-8 text (byte {exc.start})") from None
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader
    except yaml.YAMLError as exc:
        raise ValueError(f"{path.name}: cannot read preset ({str(exc)[:300]})") from None
