"""What every config section shares: the strict pydantic base ``_Section`` (unknown keys, silent
conversions and values float32/int64 cannot hold are refused), ``ConfigError``, the seed range, and the
words messages use for a YAML value and for what a field takes."""

from __future__ import annotations

from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from retrieval.common.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration file or override is invalid; the message names the key."""


_FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max: TensorFlow computes in float32
_FLOAT32_TINY = 1.1754943508222875e-38  # numpy.finfo(numpy.float32).tiny, the smallest normal float32
_INT64_MAX = 2**63 - 1
SEED_MAX = 2**32 - 1  # numpy.random.seed (set by tf.keras.utils.set_random_seed) takes 0 .. 2**32 - 1
# Every seed goes to numpy and TensorFlow: one range for all, checked when the config is loaded.
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]


class _Section(BaseModel):
    # extra="forbid" is what turns a typo such as `train.epoch` into an error
    # instead of a silently ignored key. allow_inf_nan=False refuses inf and
    # NaN in every float field (an infinite learning rate trained to NaN).
    # strict=True: a value has the field's type, nothing converts silently (lax pydantic reads
    # `epochs: true` as 1, `out_of_core: 1` or "yes" as true, "3" as 3, 3.0 as 3). The deliberate
    # conversions: an int where a float goes (`learning_rate: 1`), a YAML list where a tuple goes, and
    # YAML 1.2 floats (`1e-3`, which PyYAML reads as text: ``read_yaml``). A str field takes only
    # text: quote `run.name: '2024'` (YAML would read 2024 as a number, and 0123 as 83).
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False, strict=True
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_silent_conversions(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML lists -> tuples; a boolean where the field takes none is refused (a Literal of
        ints compares ``True == 1`` even in strict mode)."""
        if isinstance(value, list):
            return tuple(value)
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if not _admits_bool(annotation):
                raise ValueError(f"expected {_expected(annotation)}, got a boolean ({_yaml_scalar(value)})")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _fits_the_dtypes_it_is_used_in(cls, value: Any, info: ValidationInfo) -> Any:
        """Floats reach TensorFlow as float32 and ints numpy as int64: refuse values they cannot hold."""
        if isinstance(value, float) and abs(value) > _FLOAT32_MAX:
            raise ValueError(f"{value!r} overflows float32 (at most {_FLOAT32_MAX:.7g} in magnitude)")
        if isinstance(value, float) and 0 < abs(value) < _FLOAT32_TINY:
            raise ValueError(f"{value!r} underflows float32 (computes as 0; the smallest is {_FLOAT32_TINY:.7g})")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _INT64_MAX:
            raise ValueError(f"{value!r} does not fit in int64")
        return value


def _admits_bool(annotation: Any) -> bool:
    """Whether a field of this annotation takes a boolean (bool itself, Any, or a Literal of one)."""
    if annotation is bool or annotation is Any:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(member, bool) for member in get_args(annotation))
    if get_origin(annotation) in (Union, UnionType, Annotated):
        return any(_admits_bool(member) for member in get_args(annotation))
    return False


def _expected(annotation: Any) -> str:
    """What a field of this annotation takes, in words: "an integer", "one of 'auto', 0, 1, 2", ..."""
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(_yaml_scalar(member) for member in get_args(annotation))
    if get_origin(annotation) in (Union, UnionType):
        return " or ".join(_expected(member) for member in get_args(annotation))
    if get_origin(annotation) is Annotated:
        return _expected(get_args(annotation)[0])
    if get_origin(annotation) is tuple:
        return "a list"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a mapping"
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean (true or false)",
             type(None): "null"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _kind(value: Any) -> str:
    """A YAML value's kind, in words: "a boolean", "an integer", "a float", "a string", ..."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return "null" if value is None else type(value).__name__


def _yaml_scalar(value: Any) -> str:
    """A value as YAML spells it (true, null, 3, 'text'), for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)
