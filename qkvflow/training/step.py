"""The training step as `qkvflow train` takes it, for the layers that build one without training:
`qkvflow plan` compiles Levanter's step of `trainer(config)`, and `qkvflow bench` times a step with the
same loss and optimizer state. This module is their one door into `qkvflow.training`
(docs/architecture.md; tests/test_layout.py holds them to it).
"""

from levanter.trainer import Trainer

from qkvflow.training.adam import with_hypernetwork_mu_dtype
from qkvflow.training.loop import make_trainer
from qkvflow.training.loss import lm_loss, train_loss
from qkvflow.training.preflight import check_values

__all__ = ["check_values", "lm_loss", "trainer", "with_hypernetwork_mu_dtype"]


def trainer(config, trainer_config=None) -> Trainer:
    """Levanter's trainer of `config`, as `qkvflow train` builds it (`loop.make_trainer`: the optimizer with
    its decay mask, first-moment dtype and non-finite guard) with the training loss (`loss.train_loss`);
    `trainer_config` replaces `config.trainer`. Building it compiles nothing."""
    return make_trainer(config, train_loss(config), trainer_config=trainer_config)[0]
