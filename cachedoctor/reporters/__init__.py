"""reporters"""
