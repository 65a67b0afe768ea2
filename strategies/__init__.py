"""Flower strategies of sky-flower (``strategies.sky.SkyStrategy``)."""
