"""``python -m collage``: the command line, also the entry point of every rank that
``collage train --nproc N`` starts under torchrun (its command line then comes from
:func:`collage.train.distributed.launched_argv`)."""

from .cli import main
from .train.distributed import launched_argv

raise SystemExit(main(launched_argv()))
