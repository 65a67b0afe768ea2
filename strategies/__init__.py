"""Flower strategies of sky-flower (``sky_flower.strategies.sky.SkyStrategy``)."""
