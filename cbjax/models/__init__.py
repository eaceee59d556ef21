"""Pure-functional decoder models over a params pytree."""

from cbjax.models.params import check_params, init_params, param_shapes
from cbjax.models.transformer import forward

__all__ = ["forward", "init_params", "param_shapes", "check_params"]
