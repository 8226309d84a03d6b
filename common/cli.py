"""Temporary: the names that moved to errors.py, flags.py and outputs.py (removed once nothing imports it)."""
from .errors import Interrupted, UserError, run  # noqa: F401
from .flags import add_common_args, args_to_dict, check_args, restore_args  # noqa: F401
from .outputs import RUN_FILES, prepare_output_dir  # noqa: F401
