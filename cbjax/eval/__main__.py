"""`python -m cbjax.eval --model_args pretrained=<model>,<EngineArgs knob>=... --tasks ...`:
lm-eval's command line with the `cbjax` model registered and the default `--model`, and the
offline tasks shipped with it (`cbjax.eval.TASKS_DIR`) on its task path."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    import cbjax.eval  # noqa: F401  (registers the model)
    from lm_eval.__main__ import cli_evaluate

    if "--model" not in argv and not (argv and argv[0] in ("ls", "validate", "-h", "--help")):
        argv = ["run", "--model", "cbjax", *(argv[1:] if argv and argv[0] == "run" else argv)]
    if "--include_path" not in argv and not (argv and argv[0] in ("-h", "--help")):
        argv = [*argv, "--include_path", cbjax.eval.TASKS_DIR]
    sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main(sys.argv[1:])
