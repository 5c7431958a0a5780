"""What every service process is: runtime, settings, metrics and health, logging, the reply wrappers, and launching local meshes."""
