"""node/api"""
