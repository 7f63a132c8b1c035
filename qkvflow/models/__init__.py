"""Model families: configs and LM head models, declared in `qkvflow.models.registry`.

Importing any `qkvflow.models` module imports the modules below, which declare qkvflow's families
(and register their YAML type names with Levanter): a new family's module is added here.
"""

# adaptive first, as before the move to related/: Levanter's types register in this import order, which
# draccus keeps (its lists of known `type:` names)
from qkvflow.models.related import adaptive as adaptive

# isort: split
from qkvflow.models import diffeqformer as diffeqformer
from qkvflow.models import discrete as discrete
from qkvflow.models.related import halting as halting
from qkvflow.models.related import node_lm as node_lm
from qkvflow.models.related import transevolve as transevolve
