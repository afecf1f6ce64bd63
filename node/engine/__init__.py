"""node/engine"""
