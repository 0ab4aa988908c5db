"""Client-side datasets: local files, built-in sets or Python lists, mapped and encoded.

    from twinkle_client.dataset import Dataset, DatasetMeta
    dataset = Dataset(dataset_meta=DatasetMeta('ms://swift/self-cognition', data_slice=range(500)))
    dataset.set_template('Template', model_id='ms://Qwen/Qwen3.5-4B', max_length=512)
    dataset.map('SelfCognitionProcessor', init_args={'model_name': 'twinkle',
                                                     'model_author': 'ModelScope'})
    dataset.encode(batched=True)
"""

from twinkle_client.dataset.builtin import BUILTIN_DATASETS, builtin_ids
from twinkle_client.dataset.dataset import Dataset, DatasetMeta
from twinkle_client.dataset.loading import DatasetError

__all__ = ["BUILTIN_DATASETS", "Dataset", "DatasetError", "DatasetMeta", "builtin_ids"]
