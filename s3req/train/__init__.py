"""The s3req application layer: data, tokenizers, the training loop, checkpoints, sampling.

`import s3req` does not import this subpackage (it imports `models`); import it explicitly:

```python
from s3req.train import TrainConfig, train
result = train(TrainConfig(steps=100, out="runs/demo"))
```
"""

from ._checkpoint import (
    CheckpointError as CheckpointError,
    clean_checkpoint_temps as clean_checkpoint_temps,
    latest_checkpoint as latest_checkpoint,
    load_checkpoint as load_checkpoint,
    save_checkpoint as save_checkpoint,
)
from ._cli import main as main
from ._compare import compare as compare
from ._config import (
    build_model as build_model,
    model_config as model_config,
    ModelOverrides as ModelOverrides,
    MoEOverrides as MoEOverrides,
    TrainConfig as TrainConfig,
)
from ._data import (
    bpe_cached as bpe_cached,
    cache_dir as cache_dir,
    Corpus as Corpus,
    CORPUS_INSTALL_COMMAND as CORPUS_INSTALL_COMMAND,
    encode_cached as encode_cached,
    load_corpus as load_corpus,
    load_data as load_data,
    split_text as split_text,
    TokenData as TokenData,
)
from ._loop import (
    evaluate as evaluate,
    Preempted as Preempted,
    train as train,
    TrainResult as TrainResult,
)
from ._sample import load_run as load_run, sample as sample
from ._sharding import (
    batch_sharding as batch_sharding,
    init_distributed as init_distributed,
    make_mesh as make_mesh,
    param_shardings as param_shardings,
    parse_mesh as parse_mesh,
    replicated as replicated,
    shard_model as shard_model,
)
from ._state import (
    init_state as init_state,
    make_optimizer as make_optimizer,
    make_train_step as make_train_step,
    next_token_loss as next_token_loss,
    TrainState as TrainState,
)
from ._tokenizer import (
    AbstractTokenizer as AbstractTokenizer,
    BPETokenizer as BPETokenizer,
    ByteTokenizer as ByteTokenizer,
    load_tokenizer as load_tokenizer,
    train_bpe as train_bpe,
)
