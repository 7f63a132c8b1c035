"""Model families: configs and LM head models, declared in `qkvflow.models.registry`.

Importing any `qkvflow.models` module imports the modules below, which declare qkvflow's families
(and register their YAML type names with Levanter): a new family's module is added here.
"""

from qkvflow.models import adaptive as adaptive
from qkvflow.models import diffeqformer as diffeqformer
from qkvflow.models import discrete as discrete
from qkvflow.models import halting as halting
from qkvflow.models import node_lm as node_lm
from qkvflow.models import transevolve as transevolve
