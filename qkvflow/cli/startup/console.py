"""What a verb's terminal shows besides its own output."""

import logging


def quiet_checkpoint_warnings() -> None:
    """For the verbs that only read a checkpoint (export, analyze, generate): Levanter's warnings while
    it looks for and restores one are not the user's business, and the verb says what went wrong in
    its own line. Its restore warns "Unknown leaf type <class 'NoneType'>" for each absent submodule
    (e.g. a tied lm_head), and its search warns "No checkpoints found in [...]" just before the verb's
    own error; errors still show."""
    for name in ("levanter.tensorstore_serialization", "levanter.checkpoint"):
        logging.getLogger(name).setLevel(logging.ERROR)
