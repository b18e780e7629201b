"""k3: training and evaluation toolkit for the K3 hybrid architecture."""
__version__ = "0.1.0"
