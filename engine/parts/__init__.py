"""A run's state in owned parts (engine.run.Run holds them): each part declares, on every
field, whether a checkpoint saves it, records it or leaves it to set-up, and saves and
restores itself through `state_dict`/`load_state_dict` (torch's Stateful shape). A
checkpoint is the sum of the parts' state dicts (Run.state_dict), so the checkpoint code
names no field, and a field added to a part without a declaration fails the first save.

Keys are the checkpoint's own, flat and unchanged since before the parts existed: every
checkpoint written earlier resumes. A key a checkpoint lacks (written before the field)
leaves the field at its default."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

SAVED, RECORDED, TRANSIENT = "saved", "recorded", "transient"


@runtime_checkable
class Stateful(Protocol):
    """torch.distributed.checkpoint.stateful.Stateful's shape, declared here: importing
    that module imports DCP, which costs every process's start-up a second."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def saved(key: str = "", **kw) -> Any:
    """A field the checkpoint writes and a resume restores (under `key`, else its name). A
    value with its own state_dict/load_state_dict (scheduler, scaler) is saved through them."""
    return dataclasses.field(metadata={"kind": SAVED, "key": key}, **kw)


def recorded(key: str = "", **kw) -> Any:
    """A fact about the process that wrote the checkpoint (its code): written, compared by
    the resume checks (engine.checkpoint.state), never restored over the current one."""
    return dataclasses.field(metadata={"kind": RECORDED, "key": key}, **kw)


def transient(**kw) -> Any:
    """A field set-up builds again on every start (objects, the device's counters), or that
    the checkpoint's format writes itself (the model's and optimizer's tensors)."""
    return dataclasses.field(metadata={"kind": TRANSIENT}, **kw)


def kind_of(field: dataclasses.Field) -> str:
    kind = field.metadata.get("kind")
    if kind is None:
        raise TypeError(
            f"field {field.name} is declared neither saved, recorded nor transient: declare it "
            "with engine.parts.saved(), recorded() or transient()"
        )
    return kind


def key_of(field: dataclasses.Field) -> str:
    return field.metadata.get("key") or field.name


class Part:
    """The base of every part: state_dict and load_state_dict from the fields' declarations.
    A part with more to save (the RNG streams of every rank) extends them."""

    def state_dict(self) -> dict[str, Any]:
        out = {}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            if kind_of(field) == TRANSIENT:
                continue
            value = getattr(self, field.name)
            if value is not None:  # None: absent (no EMA), as in every earlier checkpoint
                out[key_of(field)] = value.state_dict() if isinstance(value, Stateful) else value
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            key = key_of(field)
            if kind_of(field) != SAVED or key not in state:
                continue
            current = getattr(self, field.name)
            if isinstance(current, Stateful):
                current.load_state_dict(state[key])
            else:
                setattr(self, field.name, state[key])
