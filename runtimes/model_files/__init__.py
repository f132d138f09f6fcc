"""What a model is before it runs: its weights' folder (`sources`), the files beside them,
its number format (`precision`) and the device memory it takes (`footprint`).
"""
