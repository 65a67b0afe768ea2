"""The ClientApp: Sky's handlers (the stages of the split LoRA model, the data owner's
batches)."""

from flwr.clientapp import ClientApp

from sky_flower.app import register_sky_client

from .task import load_data, net_fn

app = ClientApp()
register_sky_client(app, model_fn=net_fn(), load_data=load_data)
