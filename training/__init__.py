"""softsearch.training: datasets with positive generators, open_clip encoders, contrastive
objectives (InfoNCE, WEINCE), temperature schedules, Langevin noise and the trainer."""
from training.checkpoint import checkpoint_sha256, load_checkpoint, save_checkpoint
from training.config import TrainConfig, load_train_config
from training.datasets import DATASETS, ImageDataset, create_dataset, register_dataset
from training.encoder import Encoder, EncoderConfig, create_encoder, embed
from training.generators import GENERATORS, PositiveGenerator, create_generator, register_generator
from training.langevin import LangevinNoise
from training.losses import LOSSES, ContrastiveLoss, InfoNCELoss, LossOutput, create_loss, register_loss
from training.regularizers import gaussian_regularizer, vanishing_weight
from training.schedules import SCHEDULES, TemperatureSchedule, create_schedule, register_schedule
from training.synthetic import oracle_embedding
from training.trainer import train
from training.transforms import preprocess
from training.weince import WEINCEConfig, WEINCELoss, fit_tail

__all__ = [
    "DATASETS", "GENERATORS", "LOSSES", "SCHEDULES",
    "ContrastiveLoss", "Encoder", "EncoderConfig", "ImageDataset", "InfoNCELoss", "LangevinNoise",
    "LossOutput", "PositiveGenerator", "TemperatureSchedule", "TrainConfig", "WEINCEConfig", "WEINCELoss",
    "checkpoint_sha256", "create_dataset", "create_encoder", "create_generator", "create_loss",
    "create_schedule", "embed", "fit_tail", "gaussian_regularizer", "load_checkpoint", "load_train_config", "oracle_embedding",
    "preprocess", "register_dataset", "register_generator", "register_loss", "register_schedule",
    "save_checkpoint", "train", "vanishing_weight",
]
