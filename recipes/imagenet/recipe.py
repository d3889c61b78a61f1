from engine.recipe import Recipe, flip_width
from engine.vision.images import follow_weights
from recipes.imagenet.data import DataConfig, build_datasets, check_data, make_shards
from recipes.imagenet.example import write_example
from recipes.imagenet.model import ModelConfig, build_model

RECIPE = Recipe(
    model_config=ModelConfig,
    build_model=build_model,
    data_config=DataConfig,
    build_datasets=build_datasets,
    sample_shape=lambda data: (3, data.augment.train_size, data.augment.train_size),
    mirror=flip_width,
    faster_input="data.decode=gpu",
    example_data=write_example,
    check_data=check_data,
    follow_weights=follow_weights,
    make_shards=make_shards,
    # the same images from the folder or from its shards: a run may move between them
    resume_safe=("data.format", "data.shards", "data.shard_cache", "data.shard_mb"),
)
